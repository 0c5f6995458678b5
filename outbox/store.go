package outbox

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"github.com/onceco/once/internal/pgshape"
	"io/fs"
	"regexp"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceco/once/internal/migrate"
)

// DefaultTable is the outbox table's name when Config.Table is empty.
const DefaultTable = "outbox"

// ErrSchemaMismatch is wrapped by the errors of Check and Migrate (and of
// Relay.Run with RelayConfig.SkipMigrate) when the outbox table exists with
// another shape than the library needs: another library's table of the
// same name, or a hand-made one with other columns or types. The error
// names each difference.
var ErrSchemaMismatch = errors.New("outbox: table has another shape")

// ErrInvalidName is wrapped by New's errors for a schema or table name that
// is not a plain SQL identifier.
var ErrInvalidName = errors.New("outbox: invalid identifier")

// ErrStoreNotNew is wrapped by the errors of a Store's methods when the
// Store was not made by New (the zero value, or a nil *Store from a New
// whose error was dropped): it has no table name nor statements.
var ErrStoreNotNew = errors.New("outbox: Store not made by outbox.New")

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
// zero value is not usable: its methods fail with ErrStoreNotNew (Table
// and SchemaSQL return ""). A Store holds no connection and is safe for
// concurrent use.
type Store struct {
	cfg   Config
	table string // quoted, qualified
	// label names the table in metrics and spans, unquoted: "outbox",
	// or "billing.outbox" with a Schema.
	label  string
	series *migrate.Series

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
	s := &Store{cfg: cfg, table: qualify(cfg, cfg.Table), label: cfg.Table}
	if cfg.Schema != "" {
		s.label = cfg.Schema + "." + cfg.Table
	}
	sub, err := fs.Sub(migrations, "migrations")
	if err != nil {
		return nil, fmt.Errorf("outbox: migrations: %w", err)
	}
	migs, err := migrate.Load(sub, s.templateData())
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	s.series = &migrate.Series{Component: "outbox:" + cfg.Table, Schema: cfg.Schema,
		// With Schema "", the versions are kept beside the table, in the
		// schema of the search_path that holds it or will.
		Anchor:     pgx.Identifier{cfg.Table}.Sanitize(),
		Migrations: migs, Adopt: s.adopt,
		// A table of the name that the migration did not make is adopted
		// (or left alone by CREATE TABLE IF NOT EXISTS): it must have the
		// shape the relay and Add rely on.
		Verify: func(ctx context.Context, tx pgx.Tx) error { return s.Check(ctx, tx) },
		Gone:   s.gone}
	s.insertSQL = `INSERT INTO ` + s.table + ` (event_id, topic, routing_key, key, type, headers, trace, body)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[], $6::jsonb[], $7::jsonb[], $8::bytea[])`
	return s, nil
}

// made returns ErrStoreNotNew for a Store not made by New, which has no
// table nor statements: used, it panicked or sent SQL without a table name,
// whose syntax error aborted the caller's transaction.
func (s *Store) made() error {
	if s == nil || s.series == nil {
		return ErrStoreNotNew
	}
	return nil
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
	releaseUpdate, releaseDelete := s.cfg.Table+"_release_upd", s.cfg.Table+"_release_del"
	return map[string]string{
		"Table":                       s.table,
		"PendingIndex":                pgx.Identifier{s.cfg.Table + "_pending_idx"}.Sanitize(),
		"PendingIndexQualified":       qualify(s.cfg, s.cfg.Table+"_pending_idx"),
		"ReadyIndex":                  pgx.Identifier{s.cfg.Table + "_ready_idx"}.Sanitize(),
		"ReadyIndexQualified":         qualify(s.cfg, s.cfg.Table+"_ready_idx"),
		"WaitingIndex":                pgx.Identifier{s.cfg.Table + "_waiting_idx"}.Sanitize(),
		"WaitingIndexQualified":       qualify(s.cfg, s.cfg.Table+"_waiting_idx"),
		"KeyIndex":                    pgx.Identifier{s.cfg.Table + "_refused_idx"}.Sanitize(),
		"SentIndex":                   pgx.Identifier{s.cfg.Table + "_sent_idx"}.Sanitize(),
		"NotifyFunction":              qualify(s.cfg, s.cfg.Table+"_notify"),
		"NotifyTrigger":               pgx.Identifier{trigger}.Sanitize(),
		"NotifyTriggerLiteral":        "'" + trigger + "'",
		"ReleaseFunction":             qualify(s.cfg, s.cfg.Table+"_release"),
		"ReleaseUpdateTrigger":        pgx.Identifier{releaseUpdate}.Sanitize(),
		"ReleaseUpdateTriggerLiteral": "'" + releaseUpdate + "'",
		"ReleaseDeleteTrigger":        pgx.Identifier{releaseDelete}.Sanitize(),
		"ReleaseDeleteTriggerLiteral": "'" + releaseDelete + "'",
	}
}

// Table returns the quoted, schema-qualified name of the outbox table.
func (s *Store) Table() string {
	if s.made() != nil {
		return ""
	}
	return s.table
}

// SchemaSQL returns the DDL that Migrate runs, with this store's names.
func (s *Store) SchemaSQL() string {
	if s.made() != nil {
		return ""
	}
	var b strings.Builder
	for _, m := range s.series.Migrations {
		b.WriteString(m.Up)
	}
	return b.String()
}

// Migrate brings the outbox table, its indexes and its notify trigger to
// the newest schema version: the numbered migrations in migrations/, each
// once, recorded in once_schema_versions (component "outbox:<table>") in
// the table's schema, in one transaction under the advisory lock every
// migration of the library takes. It is idempotent and safe to call from
// many processes at once. A schema a newer release migrated is left as it
// is, after a check of the table's shape, when that release recorded that
// this one runs on it (every outbox step after version 1 only adds: a
// deploy rolled back); it is refused otherwise.
func (s *Store) Migrate(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}) error {
	if err := s.made(); err != nil {
		return err
	}
	if err := s.series.Migrate(ctx, db); err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	return nil
}

// gone reports whether the outbox table is missing though a version is
// recorded for it: dropped by hand after Migrate recorded the version (to
// empty it, or with 001_outbox.down.sql, which leaves the record). Migrate
// then makes it again, empty, rather than fail every relay's start asking
// for the Migrate that failed.
func (s *Store) gone(ctx context.Context, tx pgx.Tx, _ int) (bool, error) {
	var missing bool
	err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NULL`, s.table).Scan(&missing)
	return missing, err
}

// adopt recognises an outbox table made before versions were recorded as
// version 1.
func (s *Store) adopt(ctx context.Context, tx pgx.Tx) (int, error) {
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, s.table).Scan(&exists); err != nil || !exists {
		return 0, err
	}
	// Another library's table of the name is refused here, before the
	// later migrations fail on it with a bare SQL error.
	if err := s.check(ctx, tx, adoptedColumns); err != nil {
		return 0, err
	}
	return 1, nil
}

// firstColumns are the columns of schema version 1, which an adopted
// table must have before the later migrations run on it.
var firstColumns = []string{
	"seq", "bigint", "event_id", "text", "topic", "text", "routing_key", "text", "key", "bytea",
	"type", "text", "headers", "jsonb", "trace", "jsonb", "body", "bytea",
	"created_at", "timestamp with time zone", "attempts", "integer", "not_before", "timestamp with time zone",
	"last_error", "text", "parked_at", "timestamp with time zone", "sent_at", "timestamp with time zone",
}

var (
	adoptedColumns = pgshape.Cols(firstColumns...)
	outboxColumns  = pgshape.Cols(append(slices.Clone(firstColumns), "waiting", "boolean")...)
)

// defaulted are the columns Add leaves out for their defaults to fill:
// the relay reads attempts and created_at into integers and times, and
// passes over a row whose waiting is not false.
var defaulted = []string{"created_at", "attempts", "waiting"}

// nullable are the columns Add or the relay writes NULL into: the key of
// a message without one, and the marks of a row not yet sent, parked or
// delayed (Add leaves them out; a send, a requeue and a rejection short of
// parking clear them).
var nullable = []string{"key", "not_before", "parked_at", "sent_at"}

// Check verifies that the outbox table exists with the columns and types
// Add and the relay use, that seq counts up in the order rows are written
// (an identity, or a default that is the next value of a sequence, that
// neither counts down, cycles nor caches values per session, and whose
// next value, when the role may read the sequence, is above the table's
// highest seq: the relay publishes each key's rows in seq order) and that
// no other column would make Add fail (NOT NULL without a default), that
// the columns Add leaves out (created_at, attempts, waiting) have a
// default, and that the columns Add and the relay may write NULL into
// (key, not_before, parked_at, sent_at) take it. It returns nil, or an
// error wrapping ErrSchemaMismatch that names every difference. Migrate runs it, and so does Relay.Run with
// RelayConfig.SkipMigrate: a table of the name made by someone else (a
// column body of type text would take Add's bytes as their hex escape,
// and the relay publish that) fails there instead of every Add.
func (s *Store) Check(ctx context.Context, db DB) error {
	if err := s.made(); err != nil {
		return err
	}
	err := s.check(ctx, db, outboxColumns)
	if err == nil || s.check(ctx, db, adoptedColumns) != nil {
		return err
	}
	if have, cerr := pgshape.Columns(ctx, db, s.table); cerr == nil {
		if _, ok := have["waiting"]; !ok {
			// The library's table, not migrated since an older release.
			return fmt.Errorf("%w: %s is at schema version 1 (it has no column waiting): run Store.Migrate, "+
				"or apply outbox/migrations/002_waiting.up.sql", ErrSchemaMismatch, s.table)
		}
	}
	return err
}

// check is Check against the columns want.
func (s *Store) check(ctx context.Context, db DB, want []pgshape.Want) error {
	have, err := pgshape.Columns(ctx, db, s.table)
	if err != nil {
		return fmt.Errorf("outbox: checking %s: %w", s.table, err)
	}
	if len(have) == 0 {
		return fmt.Errorf("%w: %s does not exist: run Store.Migrate, or apply outbox/migrations", ErrSchemaMismatch, s.table)
	}
	diffs := pgshape.Diffs(have, want, "Add")
	if h, ok := have["seq"]; ok && h.Type == "bigint" && !h.Default {
		diffs = append(diffs, "column seq is not generated (an identity or a default): Add does not write it")
	} else if ok && h.Type == "bigint" {
		diff, err := s.checkSeqSource(ctx, db)
		if err != nil {
			return fmt.Errorf("outbox: checking %s: %w", s.table, err)
		}
		if diff != "" {
			diffs = append(diffs, diff)
		}
	}
	for _, name := range defaulted {
		if h, ok := have[name]; ok && !h.Default {
			diffs = append(diffs, fmt.Sprintf("column %s has no default: Add leaves it out for one to fill, and a row "+
				"with NULL there is never published (waiting), or breaks every read of the relay (attempts, created_at), "+
				"or is refused (NOT NULL)", name))
		}
	}
	for _, name := range nullable {
		if h, ok := have[name]; ok && h.NotNull {
			diffs = append(diffs, fmt.Sprintf("column %s is NOT NULL, and Add or the relay writes NULL there "+
				"(a message without a key; a row not yet sent, parked or delayed): those writes would be refused", name))
		}
	}
	if len(diffs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s is not the table this library needs (another library's, or made by hand?): %s",
		ErrSchemaMismatch, s.table, strings.Join(diffs, "; "))
}

// seqSourceSQL reads where the outbox table's seq takes its values: an
// identity, a generated expression or a default, and the sequence behind
// the identity or the default (by the default's dependency on it, which
// a sequence not owned by the column has too).
const seqSourceSQL = `SELECT a.attidentity <> '', a.attgenerated <> '', coalesce(pg_get_expr(d.adbin, d.adrelid), ''),
	s.seqrelid::regclass::text, s.seqincrement, s.seqcycle, s.seqcache
FROM pg_attribute a
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
LEFT JOIN pg_sequence s ON s.seqrelid = CASE WHEN a.attidentity <> '' THEN to_regclass(pg_get_serial_sequence($1, 'seq'))
	ELSE (SELECT p.refobjid FROM pg_depend p JOIN pg_class c ON c.oid = p.refobjid AND c.relkind = 'S'
		WHERE p.classid = 'pg_attrdef'::regclass AND p.objid = d.oid LIMIT 1) END
WHERE a.attrelid = to_regclass($1) AND a.attname = 'seq' AND NOT a.attisdropped`

// nextvalDefault is a default that is the next value of one sequence and
// nothing else, as pg_get_expr prints it.
var nextvalDefault = regexp.MustCompile(`^nextval\('[^']+'::regclass\)$`)

// checkSeqSource names how seq's values fail to follow the order rows are
// written in, or returns "". The relay publishes a key's rows in seq
// order, and docs/outbox.md promises that this is the order of the
// transactions that wrote them: the library's identity counts up. A
// default or a generated expression of another kind (a clock, a hash, a
// constant), or a sequence that counts down, cycles or caches values per
// session (a user's DDL, a migration that replaced the identity), passed
// the check that seq is generated at all, and the relay then published
// each key's messages in another order than they were written, without a
// word.
func (s *Store) checkSeqSource(ctx context.Context, db DB) (string, error) {
	var (
		identity, generated bool
		expr                string
		seqName             *string
		increment           *int64
		cycles              *bool
		cache               *int64
	)
	err := db.QueryRow(ctx, seqSourceSQL, s.table).Scan(&identity, &generated, &expr, &seqName, &increment, &cycles, &cache)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil // the column went meanwhile: the columns' check names it
	}
	if err != nil {
		return "", err
	}
	fix := fmt.Sprintf("make it the library's again: ALTER TABLE %[1]s ALTER COLUMN seq DROP DEFAULT "+
		"(DROP EXPRESSION for a generated column), then ALTER TABLE %[1]s ALTER COLUMN seq ADD GENERATED ALWAYS AS IDENTITY "+
		"(START WITH one more than the table's max(seq))", s.table)
	switch {
	case generated:
		return fmt.Sprintf("column seq is generated from an expression (%s), not an identity: the relay publishes "+
			"each key's rows in seq order, which would not be the order they were written in; %s", expr, fix), nil
	case seqName == nil || (!identity && !nextvalDefault.MatchString(expr)):
		return fmt.Sprintf("column seq's default is %s, not the next value of a sequence: the relay publishes "+
			"each key's rows in seq order, which would not be the order they were written in; %s", expr, fix), nil
	case *increment <= 0 || *cycles:
		what := "counts down"
		if *increment > 0 {
			what = "cycles (it starts again from its minimum once at its maximum)"
		}
		return fmt.Sprintf("column seq takes its values from sequence %s, which %s: the relay publishes each key's "+
			"rows in seq order, which would not be the order they were written in; fix it with ALTER SEQUENCE %s "+
			"INCREMENT BY 1 NO MINVALUE NO MAXVALUE NO CYCLE START WITH n RESTART WITH n, n one more than the table's max(seq) "+
			"and at least 1", *seqName, what, *seqName), nil
	case *cache > 1:
		// Each session takes its own run of values: a row written after
		// another, from another session, may get a lower seq.
		return fmt.Sprintf("column seq takes its values from sequence %s, which caches %d values per session: a row "+
			"written after another from another session may get a lower seq, and the relay publishes each key's rows "+
			"in seq order, which would not be the order they were written in; fix it with ALTER SEQUENCE %s CACHE 1",
			*seqName, *cache, *seqName), nil
	}
	return s.checkSeqAhead(ctx, db, *seqName, *increment)
}

// checkSeqAhead names a sequence whose next value is not above the
// table's highest seq, or returns "". A sequence set back, or a new one
// put in the identity's place, by a migration (rows copied in with their
// seqs, a restore of the rows without the sequence's value) gave new rows
// seqs below those of rows still pending, and the relay published them
// first: a key's messages out of order, without a word, until Add failed
// on a seq taken. The table's highest seq is read before the sequence, so
// that a row Add writes meanwhile is never taken for one ahead of it; a
// sequence the role may not read is not checked.
func (s *Store) checkSeqAhead(ctx context.Context, db DB, seqName string, increment int64) (string, error) {
	var top *int64
	var readable bool
	err := db.QueryRow(ctx, `SELECT (SELECT max(seq) FROM `+s.table+`), has_sequence_privilege($1, 'SELECT')`,
		seqName).Scan(&top, &readable)
	if err != nil || top == nil || !readable {
		return "", err
	}
	var last int64
	var called bool
	if err := db.QueryRow(ctx, `SELECT last_value, is_called FROM `+seqName).Scan(&last, &called); err != nil {
		return "", err
	}
	next := last
	if called {
		next = last + increment
	}
	if next > *top {
		return "", nil
	}
	return fmt.Sprintf("column seq takes its values from sequence %s, whose next value (%d) is not above the table's "+
		"highest seq (%d): new rows would be published before older ones of their key, and Add would fail once it "+
		"reached a seq taken; fix it with SELECT setval('%s', (SELECT max(seq) FROM %s))",
		seqName, next, *top, strings.ReplaceAll(seqName, "'", "''"), s.table), nil
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
