package outbox

import (
	"bytes"
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"sort"
	"strings"
	"text/template"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DefaultTable is the outbox table's name when Config.Table is empty.
const DefaultTable = "outbox"

// ErrInvalidName is wrapped by New's errors for a schema or table name that
// is not a plain SQL identifier.
var ErrInvalidName = errors.New("outbox: invalid identifier")

//go:embed migrations/*.sql
var migrations embed.FS

// Config names the outbox table.
type Config struct {
	// Schema holds the table. Defaults to "": an unqualified name,
	// resolved through the connection's search_path.
	Schema string
	// Table is the outbox table. Defaults to "outbox". The migration also
	// creates indexes, a trigger and a trigger function named after it.
	Table string
}

// DB is what Add needs of a connection: pgx.Tx (the point of an outbox),
// *pgx.Conn and *pgxpool.Pool all satisfy it.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Store writes and administers one outbox table. Build it with New; the
// zero value is not usable. A Store holds no connection and is safe for
// concurrent use.
type Store struct {
	cfg        Config
	table      string // quoted, qualified
	migrations []migration

	insertSQL string
}

// identifier is a plain SQL identifier short enough for the suffixes the
// migration appends (63 bytes at most in PostgreSQL).
var identifier = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,47}$`)

// New validates cfg and prepares the store's statements. Names must match
// [A-Za-z_][A-Za-z0-9_]* and be at most 48 bytes long; anything else fails
// with an error wrapping ErrInvalidName that names the field.
func New(cfg Config) (*Store, error) {
	if cfg.Table == "" {
		cfg.Table = DefaultTable
	}
	if !identifier.MatchString(cfg.Table) {
		return nil, fmt.Errorf("%w: Table %q must match %s", ErrInvalidName, cfg.Table, identifier)
	}
	if cfg.Schema != "" && !identifier.MatchString(cfg.Schema) {
		return nil, fmt.Errorf("%w: Schema %q must match %s", ErrInvalidName, cfg.Schema, identifier)
	}
	s := &Store{cfg: cfg, table: qualify(cfg, cfg.Table)}
	migs, err := loadMigrations(migrations, s.templateData())
	if err != nil {
		return nil, err
	}
	s.migrations = migs
	s.insertSQL = `INSERT INTO ` + s.table + ` (event_id, topic, routing_key, key, type, headers, trace, body)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::jsonb[], $7::jsonb[], $8::bytea[])`
	return s, nil
}

// qualify quotes name, in cfg.Schema when one is set.
func qualify(cfg Config, name string) string {
	if cfg.Schema == "" {
		return pgx.Identifier{name}.Sanitize()
	}
	return pgx.Identifier{cfg.Schema, name}.Sanitize()
}

// templateData are the names the migration templates use.
func (s *Store) templateData() map[string]string {
	trigger := s.cfg.Table + "_notify"
	return map[string]string{
		"Table":                s.table,
		"PendingIndex":         pgx.Identifier{s.cfg.Table + "_pending_idx"}.Sanitize(),
		"KeyIndex":             pgx.Identifier{s.cfg.Table + "_refused_idx"}.Sanitize(),
		"SentIndex":            pgx.Identifier{s.cfg.Table + "_sent_idx"}.Sanitize(),
		"NotifyFunction":       qualify(s.cfg, s.cfg.Table+"_notify"),
		"NotifyTrigger":        pgx.Identifier{trigger}.Sanitize(),
		"NotifyTriggerLiteral": "'" + trigger + "'",
	}
}

// Table returns the quoted, schema-qualified name of the outbox table.
func (s *Store) Table() string { return s.table }

// migration is one numbered step of the outbox schema.
type migration struct {
	version  int
	name     string
	up, down string
}

var migrationFile = regexp.MustCompile(`^([0-9]+)_([a-z0-9_]+)\.(up|down)\.sql$`)

// loadMigrations renders every migrations/NNN_name.{up,down}.sql template
// with data, in version order.
func loadMigrations(fsys embed.FS, data any) ([]migration, error) {
	entries, err := fs.ReadDir(fsys, "migrations")
	if err != nil {
		return nil, fmt.Errorf("outbox: migrations: %w", err)
	}
	byVersion := map[int]*migration{}
	for _, e := range entries {
		m := migrationFile.FindStringSubmatch(e.Name())
		if m == nil {
			return nil, fmt.Errorf("outbox: migrations: %s is not named NNN_name.up.sql or NNN_name.down.sql", e.Name())
		}
		var version int
		fmt.Sscan(m[1], &version) //nolint:errcheck // the pattern admits digits only
		text, err := renderTemplate(fsys, "migrations/"+e.Name(), data)
		if err != nil {
			return nil, err
		}
		mig := byVersion[version]
		if mig == nil {
			mig = &migration{version: version, name: m[2]}
			byVersion[version] = mig
		}
		if m[3] == "up" {
			mig.up = text
		} else {
			mig.down = text
		}
	}
	out := make([]migration, 0, len(byVersion))
	for _, m := range byVersion {
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].version < out[j].version })
	return out, nil
}

func renderTemplate(fsys embed.FS, name string, data any) (string, error) {
	src, err := fsys.ReadFile(name)
	if err != nil {
		return "", fmt.Errorf("outbox: migrations: %w", err)
	}
	t, err := template.New(name).Option("missingkey=error").Parse(string(src))
	if err != nil {
		return "", fmt.Errorf("outbox: migrations: %w", err)
	}
	var b bytes.Buffer
	if err := t.Execute(&b, data); err != nil {
		return "", fmt.Errorf("outbox: migrations: %w", err)
	}
	return b.String(), nil
}

// SchemaSQL returns the DDL that Migrate runs, with this store's names.
func (s *Store) SchemaSQL() string {
	var b strings.Builder
	for _, m := range s.migrations {
		b.WriteString(m.up)
	}
	return b.String()
}

// migrateLock is the advisory lock key that serialises concurrent
// migrations; it is the key dedup's Migrate takes, so that the module's
// migrations never run at the same time.
const migrateLock = 0x6f6e6365 // "once"

// Migrate creates the outbox table, its indexes and its notify trigger if
// they do not exist, running every up migration in one transaction under
// an advisory lock. It is idempotent and safe to call from many processes
// at once.
func (s *Store) Migrate(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("outbox: migrate: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", migrateLock); err != nil {
		return fmt.Errorf("outbox: migrate: %w", err)
	}
	for _, m := range s.migrations {
		if _, err := tx.Exec(ctx, m.up); err != nil {
			return fmt.Errorf("outbox: migrate %03d_%s: %w", m.version, m.name, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("outbox: migrate: %w", err)
	}
	return nil
}

// Migrate creates the default outbox table ("outbox" on the search_path);
// see Store.Migrate.
func Migrate(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}) error {
	return defaultStore.Migrate(ctx, db)
}

// defaultStore is the store of the package-level functions.
var defaultStore = func() *Store {
	s, err := New(Config{})
	if err != nil {
		panic(err) // the default names are valid
	}
	return s
}()
