package idempotency

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Table is the name of the table that holds the keys and their responses.
const Table = "idempotency_keys"

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations holds the numbered DDL files, NNN_name.up.sql and
// NNN_name.down.sql, in the layout golang-migrate and goose read. Their
// names are unqualified: they create the table in the first schema of the
// search_path. Migrate applies the up files; use this for a migration tool
// of your own.
var Migrations fs.FS = mustSub(migrationFiles, "migrations")

func mustSub(f fs.FS, dir string) fs.FS {
	sub, err := fs.Sub(f, dir)
	if err != nil {
		panic(err)
	}
	return sub
}

// ErrInvalidName is wrapped by the errors of New and Migrate for a schema
// name that is not a plain SQL identifier.
var ErrInvalidName = errors.New("idempotency: invalid identifier")

// identifier is a plain, unquoted SQL identifier of at most 63 bytes,
// PostgreSQL's limit.
var identifier = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

func checkSchema(schema string) error {
	if schema != "" && !identifier.MatchString(schema) {
		return fmt.Errorf("%w: Schema %q must match %s", ErrInvalidName, schema, identifier)
	}
	return nil
}

// migrateLock is the advisory lock key that serialises concurrent
// migrations; the dedup package uses the same key, so all of the library's
// DDL runs one migration at a time.
const migrateLock = 0x6f6e6365 // "once"

// Beginner begins a transaction: *pgxpool.Pool and *pgx.Conn satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Migrate creates the idempotency_keys table and its index in schema ("":
// the first schema of the connection's search_path; give the schema of
// processed_events to keep both in one place). It runs every up file of
// Migrations in order, in one transaction under an advisory lock; the files
// are idempotent, so Migrate is safe to call on every start and from many
// processes at once. The schema must exist.
func Migrate(ctx context.Context, db Beginner, schema string) error {
	if err := checkSchema(schema); err != nil {
		return err
	}
	files, err := upFiles()
	if err != nil {
		return fmt.Errorf("idempotency: migrate: %w", err)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("idempotency: migrate: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", migrateLock); err != nil {
		return fmt.Errorf("idempotency: migrate: %w", err)
	}
	if schema != "" {
		// The files' names are unqualified: point them at the schema for
		// this transaction only.
		if _, err := tx.Exec(ctx, "SET LOCAL search_path TO "+pgx.Identifier{schema}.Sanitize()); err != nil {
			return fmt.Errorf("idempotency: migrate: %w", err)
		}
	}
	for _, f := range files {
		if _, err := tx.Exec(ctx, f.sql); err != nil {
			return fmt.Errorf("idempotency: migrate: %s: %w", f.name, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("idempotency: migrate: %w", err)
	}
	return nil
}

type migrationFile struct{ name, sql string }

// upFiles returns the up files of Migrations in the order of their numbers.
func upFiles() ([]migrationFile, error) {
	names, err := fs.Glob(Migrations, "*.up.sql")
	if err != nil {
		return nil, err
	}
	sort.Strings(names) // zero-padded numbers sort as numbers
	files := make([]migrationFile, 0, len(names))
	for _, name := range names {
		b, err := fs.ReadFile(Migrations, name)
		if err != nil {
			return nil, err
		}
		files = append(files, migrationFile{name: name, sql: string(b)})
	}
	return files, nil
}

// statements are the store's SQL, with the table's name qualified by the
// configured schema.
type statements struct {
	setLockTimeout, restoreLockTimeout string
	lockKey, lockNamespace             string
	claim, lookup, deleteExpired       string
	saveResponse, retention            string
}

func newStatements(schema string) statements {
	table := pgx.Identifier{Table}.Sanitize()
	if schema != "" {
		table = pgx.Identifier{schema, Table}.Sanitize()
	}
	where := ` WHERE scope = $1 AND idempotency_key = $2`
	return statements{
		// The wait for a transaction that holds the same key is bounded by
		// lock_timeout, set around lockKey only: the claim's INSERT and the
		// handler's statements run under the session's own setting, saved
		// in a custom setting and restored after lockKey.
		setLockTimeout: `SELECT set_config('once.saved_lock_timeout', current_setting('lock_timeout'), true),
	set_config('lock_timeout', $1, true)`,
		restoreLockTimeout: `SELECT set_config('lock_timeout', current_setting('once.saved_lock_timeout'), true)`,
		// A transaction-scoped advisory lock on the key's hash marks the
		// key in flight: held from the claim to the commit or rollback,
		// released by PostgreSQL when the connection dies. It is taken
		// only while the key has no live stored response, so replays of a
		// completed key never queue behind each other. The INSERT alone
		// cannot carry the bound: under lock_timeout, any other lock wait
		// of an INSERT (extending the table under concurrent inserts) would
		// become a false 409.
		lockKey: `SELECT pg_advisory_xact_lock(hashtextextended($3 || ':' || length($1)::text || ':' || $1 || $2, 0))
WHERE NOT EXISTS (SELECT 1 FROM ` + table + where + ` AND expires_at > now())`,
		// One namespace for every table and schema: two middlewares that
		// name one table differently ("" and "public") still exclude each
		// other; other keys sharing a hash only wait needlessly.
		lockNamespace: "once.idempotency",
		claim: `INSERT INTO ` + table + ` (scope, idempotency_key, fingerprint, method, path, expires_at)
VALUES ($1, $2, $3, $4, $5, now() + $6::float8 * interval '1 second') ON CONFLICT DO NOTHING`,
		lookup:        `SELECT fingerprint, status, header, body, expires_at <= now() FROM ` + table + where,
		deleteExpired: `DELETE FROM ` + table + where + ` AND expires_at <= now()`,
		saveResponse:  `UPDATE ` + table + ` SET status = $3, header = $4, body = $5` + where,
		retention: `DELETE FROM ` + table + ` WHERE ctid = ANY(ARRAY(SELECT ctid FROM ` + table +
			` WHERE expires_at <= now() LIMIT $1))`,
	}
}

// lockTimeoutSetting is the lock_timeout value for a claim that waits up to
// wait: at least 1ms, because 0 would mean no limit.
func lockTimeoutSetting(wait time.Duration) string {
	return fmt.Sprintf("%dms", max(1, wait.Milliseconds()))
}

// execer is what retention needs of a connection.
type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// deleteExpired removes expired keys, batchSize rows per statement, each
// statement its own short transaction, until fewer than batchSize are left.
func (s statements) deleteAllExpired(ctx context.Context, db execer, batchSize int) (int64, error) {
	var total int64
	for {
		tag, err := db.Exec(ctx, s.retention, batchSize)
		if err != nil {
			return total, fmt.Errorf("idempotency: retention: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batchSize) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}

// isLockTimeout reports whether err is PostgreSQL's lock_not_available,
// which a claim gets when another transaction held its key past the wait.
func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}

// isAborted reports whether err says the transaction was aborted by an
// earlier failed statement.
func isAborted(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "25P02"
}

// isSerializationFailure reports whether err is PostgreSQL's
// serialization_failure.
func isSerializationFailure(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "40001"
}
