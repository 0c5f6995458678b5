package idempotency

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceco/once/internal/migrate"
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

// Beginner begins a transaction: *pgxpool.Pool and *pgx.Conn satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// ErrSchemaNewer is wrapped by Migrate's error when the database records
// a schema version of idempotency_keys newer than this release knows: a
// newer release of the library migrated it. Nothing is changed, and
// retrying cannot succeed; run the newer release.
var ErrSchemaNewer = migrate.ErrNewer

// Migrate brings the idempotency_keys table and its index to the newest
// schema version, in schema ("": the first schema of the connection's
// search_path; give the schema of processed_events to keep both in one
// place). It runs the numbered files of Migrations through the library's
// versioned migrations: each version once, recorded in
// once_schema_versions (component "idempotency:idempotency_keys") in the
// table's schema, in one transaction under the advisory lock every
// migration of the library takes; it is safe to call on every start and
// from many processes at once, and it refuses a schema a newer release
// migrated (an error wrapping ErrSchemaNewer). The schema must exist. A
// table of the name that exists already (another library's, one made by
// hand) is checked, not changed:
// Migrate fails with an error wrapping ErrSchemaMismatch, naming each
// difference, when it lacks a column the middleware needs, has one it
// cannot leave out, is unlogged (a crash would empty it), or has no unique
// key that tells every (scope, idempotency_key) apart.
func Migrate(ctx context.Context, db Beginner, schema string) error {
	series, err := newSeries(schema)
	if err != nil {
		return err
	}
	if err := series.Migrate(ctx, db); err != nil {
		return fmt.Errorf("idempotency: %w", err)
	}
	return nil
}

// newSeries is the versioned series of the store's migrations in schema.
func newSeries(schema string) (*migrate.Series, error) {
	if err := checkSchema(schema); err != nil {
		return nil, err
	}
	migrations, err := migrate.Load(Migrations, nil)
	if err != nil {
		return nil, fmt.Errorf("idempotency: %w", err)
	}
	return &migrate.Series{
		Component: "idempotency:" + Table,
		Schema:    schema,
		// With schema "", the versions are kept beside the table, in the
		// schema of the search_path that holds it or will.
		Anchor:     pgx.Identifier{Table}.Sanitize(),
		SearchPath: true, // the files name the table unqualified
		Migrations: migrations,
		Adopt: func(ctx context.Context, tx pgx.Tx) (int, error) {
			// A table made before versions were recorded is version 1.
			var exists bool
			err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, qualified(schema)).Scan(&exists)
			if exists {
				return 1, err
			}
			return 0, err
		},
		// Any table of the name was adopted as version 1 or left as it
		// was by CREATE TABLE IF NOT EXISTS: it must be one the claim
		// can rely on.
		Verify: func(ctx context.Context, tx pgx.Tx) error { return checkTable(ctx, tx, qualified(schema)) },
	}, nil
}

// qualified is the table's name in schema, quoted.
func qualified(schema string) string {
	if schema == "" {
		return pgx.Identifier{Table}.Sanitize()
	}
	return pgx.Identifier{schema, Table}.Sanitize()
}

// statements are the store's SQL, with the table's name qualified by the
// configured schema.
type statements struct {
	saveLockTimeout, restoreLockTimeout string
	lockKey, lockNamespace, keyHeld     string
	claim, lookup, deleteExpired        string
	saveResponse, retention             string
}

func newStatements(schema string) statements {
	table := qualified(schema)
	// lockName is what the key's lock is a hash of ($1 scope, $2 key, $3
	// namespace).
	lockName := `$3 || ':' || '` + table + `'::regclass::oid::text || ':' || length($1)::text || ':' || $1 || $2`
	where := ` WHERE scope = $1 AND idempotency_key = $2`
	return statements{
		// The wait for a transaction that holds the same key is bounded by
		// lock_timeout, set for the advisory lock only: the claim's INSERT
		// and the handler's statements run under the session's own setting,
		// saved in a custom setting and restored after lockKey.
		saveLockTimeout:    `SELECT set_config('once.saved_lock_timeout', current_setting('lock_timeout'), true)`,
		restoreLockTimeout: `SELECT set_config('lock_timeout', current_setting('once.saved_lock_timeout'), true)`,
		// A transaction-scoped advisory lock on the key's hash marks the
		// key in flight: held from the claim to the commit or rollback,
		// released by PostgreSQL when the connection dies. It is taken
		// only while the key has no live stored response, so replays of a
		// completed key never queue behind each other. The INSERT alone
		// cannot carry the bound: under lock_timeout, any other lock wait
		// of an INSERT (extending the table under concurrent inserts) would
		// become a false 409.
		//
		// The lock is the key's in its table: the table's oid is part of
		// what is hashed, so that two middlewares that name one table
		// differently ("" and "public") exclude each other, and the same
		// key in another table (another service's schema, a parallel
		// test's) is not in flight; other keys sharing a hash only wait
		// needlessly.
		//
		// lock_timeout ($4) is set in the lock's own argument, so that it
		// bounds that wait alone: the statement's locks on the table and
		// its index are taken before it executes, under the session's
		// setting. Were they under the short one, a brief lock on the table
		// (autovacuum truncating its empty tail, a DDL statement, a
		// REINDEX) would make a key no one else sent a 409.
		lockKey: `SELECT pg_advisory_xact_lock(hashtextextended(left(set_config('lock_timeout', $4, true), 0) ||
	` + lockName + `, 0))
WHERE NOT EXISTS (SELECT 1 FROM ` + table + where + ` AND expires_at > now())`,
		// keyHeld tells whether another transaction holds the key's lock:
		// it tries the lock (held to the statement's end only, and waiting
		// for nothing, the table's locks included: it does not read the
		// table). A lock_timeout that ended a claim is the wait for the key
		// only if it is.
		keyHeld:       `SELECT NOT pg_try_advisory_xact_lock(hashtextextended(` + lockName + `, 0))`,
		lockNamespace: "once.idempotency",
		// The claim names its key: a table without a valid, immediate
		// unique key on (scope, idempotency_key) (one made by hand, one
		// partitioned by a column outside the key) fails every claim
		// instead of taking the key again for each request.
		claim: `INSERT INTO ` + table + ` (scope, idempotency_key, fingerprint, method, path, expires_at)
VALUES ($1, $2, $3, $4, $5, now() + $6::float8 * interval '1 second') ON CONFLICT (scope, idempotency_key) DO NOTHING`,
		lookup:        `SELECT fingerprint, status, header, body, expires_at <= now() FROM ` + table + where,
		deleteExpired: `DELETE FROM ` + table + where + ` AND expires_at <= now()`,
		// The TTL starts with the response, not with the request's
		// transaction (now()): a request that ran longer than the TTL
		// would store a response already expired, and its retry would
		// run the handler again.
		saveResponse: `UPDATE ` + table + ` SET status = $3, header = $4, body = $5,
	expires_at = clock_timestamp() + $6::float8 * interval '1 second'` + where,
		// The DELETE checks the condition again: in a partitioned table
		// each partition has rows of every ctid, and only expired keys may
		// go (another partition's expired key of the same ctid goes with
		// the batch). Rows another transaction holds are skipped: a
		// request reusing an expired key deletes its row and runs its
		// handler with the row locked, and a sweep that waited for it would
		// hold its whole batch (and every request with one of its keys)
		// for as long as that handler runs. A skipped row goes at a later
		// sweep, or with its request.
		retention: `DELETE FROM ` + table + ` WHERE ctid = ANY(ARRAY(SELECT ctid FROM ` + table +
			` WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED)) AND expires_at <= now()`,
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

// isQueryCanceled reports whether err is PostgreSQL's query_canceled: a
// statement_timeout expired, or someone canceled the statement.
func isQueryCanceled(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "57014"
}
