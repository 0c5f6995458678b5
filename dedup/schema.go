package dedup

import (
	"github.com/onceco/once/internal/pgshape"

	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/onceco/once/internal/migrate"
)

//go:embed schema/*.sql
var schemaFiles embed.FS

// SchemaVersion is the newest schema version this package knows, the one
// Migrate brings the tables to. The plain SQL files in migrations/ go up to
// the same version.
const SchemaVersion = 5

// ErrSchemaNewer is wrapped by Migrate's and MigrateTo's errors when the
// database records a schema version newer than SchemaVersion: a newer
// release of the library migrated it. Nothing is changed; run the newer
// release, or move the schema back down with it first. Migrate does not
// return it when the release that migrated the database recorded that this
// one runs on it (each step above SchemaVersion only adds): it checks the
// tables and leaves them as they are.
var ErrSchemaNewer = migrate.ErrNewer

// ErrSchemaMismatch is wrapped by the errors of Check and Migrate when a
// table exists with another shape than the store needs (another library's
// table of the same name, or a hand-made one): the error names each
// difference.
var ErrSchemaMismatch = errors.New("dedup: table has another shape")

// schemaNames are the names the migration templates use, quoted (and
// qualified where a statement needs it).
type schemaNames struct {
	Table, Attempts, Offsets            string // qualified tables
	ProcessedAtIndex, ProcessedAtIndexQ string // bare and qualified
	ConsumerIndex, ConsumerIndexQ       string
}

func newSchemaNames(schema, table string) schemaNames {
	qualify := func(name string) string {
		if schema == "" {
			return pgx.Identifier{name}.Sanitize()
		}
		return pgx.Identifier{schema, name}.Sanitize()
	}
	bare := func(name string) string { return pgx.Identifier{name}.Sanitize() }
	return schemaNames{
		Table:             qualify(table),
		Attempts:          qualify(table + "_attempts"),
		Offsets:           qualify(table + "_offsets"),
		ProcessedAtIndex:  bare(table + "_processed_at_idx"),
		ProcessedAtIndexQ: qualify(table + "_processed_at_idx"),
		ConsumerIndex:     bare(table + "_consumer_processed_at_idx"),
		ConsumerIndexQ:    qualify(table + "_consumer_processed_at_idx"),
	}
}

// loadMigrations renders the embedded migrations with names.
func loadMigrations(names schemaNames) ([]migrate.Migration, error) {
	sub, err := fs.Sub(schemaFiles, "schema")
	if err != nil {
		return nil, err
	}
	migs, err := migrate.Load(sub, names)
	if err != nil {
		return nil, err
	}
	if len(migs) != SchemaVersion {
		return nil, fmt.Errorf("dedup: %d embedded migrations, SchemaVersion is %d", len(migs), SchemaVersion)
	}
	return migs, nil
}

// newSeries is the store's migration series: the component is named after
// the table, so that two stores with different tables in one schema have
// versions of their own.
func (s *Store) newSeries(schema, table string, migs []migrate.Migration) *migrate.Series {
	return &migrate.Series{
		Component:  "dedup:" + table,
		Schema:     schema,
		Anchor:     pgx.Identifier{table}.Sanitize(),
		Migrations: migs,
		Adopt:      s.adopt,
		// The offsets table too: version 4 created it, or found a table
		// of that name, maybe another store's, which going down from
		// version 4 would drop.
		Verify: func(ctx context.Context, tx pgx.Tx) error {
			return errors.Join(s.Check(ctx, tx), s.CheckOffsets(ctx, tx), s.checkRetentionIndex(ctx, tx))
		},
		Gone: s.gone,
	}
}

// gone reports whether a table that schema version version has is missing:
// dropped or renamed by hand after Migrate recorded the version (a DBA
// clearing the crash guard's records with DROP TABLE). Migrate then makes
// it again, empty, rather than fail every start on a missing table.
func (s *Store) gone(ctx context.Context, tx pgx.Tx, version int) (bool, error) {
	tables := []string{s.names.Table, s.names.Attempts}
	if version >= offsetsVersion {
		tables = append(tables, s.names.Offsets)
	}
	var missing bool
	err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM unnest($1::text[]) AS t WHERE to_regclass(t) IS NULL)`, tables).Scan(&missing)
	return missing, err
}

// offsetsVersion is the schema version that creates the offsets table.
const offsetsVersion = 4

// adopt recognises the tables that no version was recorded for: made by
// the unversioned releases (the shape of version 1), or by the plain SQL
// files of dedup/migrations run with goose, golang-migrate or by hand, up
// to some version. They are recorded at the version their shape has, after
// a check that the processed-events table is the store's and not another
// library's: version 1, and each later version whose step is in place
// (version 2's index on (consumer, processed_at) without the old one,
// version 3's crashes, version 4's offsets table of the store's shape,
// version 5's last_error), up to the first that is not. A down migration
// then undoes what is there: adopted as version 1, tables at version 5
// lost their processed-events and attempts tables to MigrateTo 0 and kept
// the offsets table, with its positions. With the processed-events table
// alone, version 1 runs (its statements are idempotent) to add what is
// missing.
func (s *Store) adopt(ctx context.Context, tx pgx.Tx) (int, error) {
	processed, err := exists(ctx, tx, s.names.Table)
	if err != nil || !processed {
		return 0, err
	}
	if err := s.checkTable(ctx, tx, s.names.Table, processedColumns); err != nil {
		return 0, err
	}
	attempts, err := pgshape.Columns(ctx, tx, s.names.Attempts)
	if err != nil || attempts == nil {
		return 0, err
	}
	var v2 bool
	err = tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_index WHERE indexrelid = to_regclass($1) AND indrelid = to_regclass($2) AND indisvalid)
	AND NOT EXISTS (SELECT 1 FROM pg_index WHERE indexrelid = to_regclass($3) AND indrelid = to_regclass($2))`,
		s.names.ConsumerIndexQ, s.names.Table, s.names.ProcessedAtIndexQ).Scan(&v2)
	if err != nil || !v2 {
		return 1, err
	}
	if _, ok := attempts["crashes"]; !ok {
		return 2, nil
	}
	if err := s.CheckOffsets(ctx, tx); errors.Is(err, ErrSchemaMismatch) {
		return 3, nil
	} else if err != nil {
		return 0, err
	}
	if _, ok := attempts["last_error"]; !ok {
		return 4, nil
	}
	return 5, nil
}

// exists reports whether the (quoted, maybe qualified) table exists.
func exists(ctx context.Context, db DB, table string) (bool, error) {
	var ok bool
	err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&ok)
	return ok, err
}

// SchemaSQL returns every up migration, in order, with this store's names:
// the DDL that Migrate runs on an empty database, for review or to run by
// hand. Each statement is idempotent (IF NOT EXISTS, IF EXISTS).
func (s *Store) SchemaSQL() string {
	var b strings.Builder
	for _, m := range s.series.Migrations {
		b.WriteString(m.Up)
	}
	return b.String()
}

// Migrate brings the store's tables to SchemaVersion: it creates them, or
// runs the migrations from the version the database records (tables made
// before versions were recorded are recognised as version 1), records each
// version in the once_schema_versions table of the store's schema, then
// checks the tables' shape (see Check and CheckOffsets). A table of the
// recorded version that is gone (dropped by hand) is made again, empty,
// by running that version's steps again. Everything runs in one transaction
// under an advisory lock: it is idempotent and safe to call from many
// processes at once, and on an error nothing has changed.
//
// It fails with an error wrapping ErrSchemaNewer when the database is at a
// newer version than this package knows, unless the release that migrated
// it recorded that this one runs on it (then it checks the tables and
// leaves them as they are; see ErrSchemaNewer), and with one wrapping
// ErrSchemaMismatch, naming each difference, when a table of the store's
// name has another shape. db is typically a *pgxpool.Pool.
func (s *Store) Migrate(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}) error {
	return s.MigrateTo(ctx, db, s.series.Latest())
}

// MigrateTo moves the store's tables up or down to version (0 to
// SchemaVersion), in one transaction. Version 0 drops the tables and every
// row in them, which ends deduplication: use it to remove the store, and
// lower versions to go back to an older release of the library before
// deploying it. Errors are Migrate's, and a version out of range.
func (s *Store) MigrateTo(ctx context.Context, db interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}, version int) error {
	if err := s.series.MigrateTo(ctx, db, version); err != nil {
		return fmt.Errorf("dedup: %w", err)
	}
	return nil
}

// Version returns the schema version the database records for the store's
// tables: 0 when none is recorded (no tables, or tables made by a plain SQL
// file or an unversioned release, which Migrate recognises).
func (s *Store) Version(ctx context.Context, db DB) (int, error) {
	v, err := s.series.Version(ctx, db)
	if err != nil {
		return 0, fmt.Errorf("dedup: %w", err)
	}
	return v, nil
}

// ProcessedTable returns the qualified, quoted name of the table that
// holds the claims (Config.Table), for use in SQL text.
func (s *Store) ProcessedTable() string { return s.names.Table }

// AttemptsTable returns the qualified, quoted name of the table in which
// the consumer keeps its crash-guard records (Config.Table with the suffix
// "_attempts"), for use in SQL text.
func (s *Store) AttemptsTable() string { return s.names.Attempts }

var processedColumns = pgshape.Cols(
	"consumer", "text", "event_id", "text", "fingerprint", "bytea",
	"processed_at", "timestamp with time zone", "source", "text",
	"partition", "integer", "offset", "bigint",
)

var attemptsColumns = pgshape.Cols(
	"consumer", "text", "event_id", "text", "attempts", "integer",
	"last_seen", "timestamp with time zone", "crashes", "integer",
	"last_error", "jsonb",
)

// Check verifies that the store's tables exist with the columns and types
// it needs and a primary key or unique index on (consumer, event_id), and
// that no other column would make its inserts fail (NOT NULL without a
// default), that processed_at and last_seen, which the inserts leave out,
// have a default, and that the columns the store may write NULL into
// (fingerprint, partition, offset, last_error) take it, and that no unique
// index or exclusion constraint (each an arbiter of the claims' ON
// CONFLICT) takes two distinct ids, or one id of two consumers, for one.
// It returns nil, or an error wrapping ErrSchemaMismatch that
// names every difference. Migrate runs it; a consumer whose schema is
// managed by other tools (Config.SkipMigrate) runs it at start, so that a
// table of another shape fails start-up instead of every claim.
func (s *Store) Check(ctx context.Context, db DB) error {
	return errors.Join(
		s.checkTable(ctx, db, s.names.Table, processedColumns),
		s.checkTable(ctx, db, s.names.Attempts, attemptsColumns),
	)
}

// CheckUnrecorded is Check for tables of which the database records no
// schema version (made by a release before versions were recorded, by
// goose or golang-migrate run part of the way, by hand): it says whether
// they are tables Migrate takes on and completes, not whether they are at
// the newest version. The processed-events table must have the store's
// shape, as Migrate requires before it adopts it; the attempts table, when
// it exists, must have the columns of version 1, and those that later
// versions add (crashes, last_error) where it has them already, with their
// types; the offsets table, when it exists, must be the store's. It
// returns nil, or an error wrapping ErrSchemaMismatch that names every
// difference.
func (s *Store) CheckUnrecorded(ctx context.Context, db DB) error {
	errs := []error{s.checkTable(ctx, db, s.names.Table, processedColumns)}
	have, err := pgshape.Columns(ctx, db, s.names.Attempts)
	if err != nil {
		return fmt.Errorf("dedup: checking %s: %w", s.names.Attempts, err)
	}
	if have != nil {
		want := slices.Clone(attemptsColumns[:attemptsV1Columns])
		for _, c := range attemptsColumns[attemptsV1Columns:] {
			if _, ok := have[c.Name]; ok {
				want = append(want, c)
			}
		}
		errs = append(errs, s.checkTable(ctx, db, s.names.Attempts, want))
	}
	offsets, err := exists(ctx, db, s.names.Offsets)
	if err != nil {
		return fmt.Errorf("dedup: checking %s: %w", s.names.Offsets, err)
	}
	if offsets {
		errs = append(errs, s.CheckOffsets(ctx, db))
	}
	return errors.Join(errs...)
}

// attemptsV1Columns is how many of attemptsColumns, in order, version 1
// creates; versions 3 and 5 add the others.
const attemptsV1Columns = 4

// checkTable compares one table with the columns the store needs.
func (s *Store) checkTable(ctx context.Context, db DB, table string, want []pgshape.Want) error {
	have, err := pgshape.Columns(ctx, db, table)
	if err != nil {
		return fmt.Errorf("dedup: checking %s: %w", table, err)
	}
	if have == nil {
		return fmt.Errorf("%w: %s does not exist: run Store.Migrate, or apply dedup/migrations", ErrSchemaMismatch, table)
	}
	diffs := pgshape.Diffs(have, want, "the store")
	defaulted, nullable := s.writes(table)
	if h, ok := have[defaulted]; ok && !h.Default {
		diffs = append(diffs, fmt.Sprintf("column %s has no default: the store's inserts leave it out for one (now()) to fill, "+
			"and without it a row gets NULL there, which retention never deletes, or is refused", defaulted))
	}
	for _, col := range nullable {
		if h, ok := have[col]; ok && h.NotNull {
			diffs = append(diffs, fmt.Sprintf("column %s is NOT NULL, and the store writes NULL there "+
				"(a claim without a fingerprint, partition or offset, as a RabbitMQ message's; a crash-guard record without a failure): "+
				"those writes would be refused", col))
		}
	}
	unique, err := hasUniqueKey(ctx, db, table, "consumer", "event_id")
	if err != nil {
		return fmt.Errorf("dedup: checking %s: %w", table, err)
	}
	if !unique {
		diffs = append(diffs, "no primary key or unique index on (consumer, event_id)")
	}
	merging, err := mergingKeys(ctx, db, table, want)
	if err != nil {
		return fmt.Errorf("dedup: checking %s: %w", table, err)
	}
	for _, name := range merging {
		diffs = append(diffs, fmt.Sprintf("%s takes distinct (consumer, event_id) for one: its key needs both columns, each under a deterministic collation", name))
	}
	if table == s.names.Table {
		// The claims' ON CONFLICT names no target: every unique or
		// exclusion index is an arbiter, and a deferrable one fails
		// the statement.
		deferrable, err := deferrableArbiters(ctx, db, table)
		if err != nil {
			return fmt.Errorf("dedup: checking %s: %w", table, err)
		}
		for _, name := range deferrable {
			diffs = append(diffs, fmt.Sprintf("constraint %s is deferrable: every unique or exclusion constraint arbitrates the claims' ON CONFLICT, which cannot use a deferrable one", name))
		}
	}
	if len(diffs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s is not the table this library needs (another library's, or made by hand?): %s",
		ErrSchemaMismatch, table, strings.Join(diffs, "; "))
}

// writes says what the store's inserts into table (its processed-events
// or attempts table) need of two kinds of columns: defaulted, the column
// they leave out for its default, now(), to fill (the age retention
// reads: without a default a claim stores NULL there, which no cutoff
// deletes and a duplicate's lookup cannot read, or, NOT NULL, every insert
// is refused); and nullable, the columns they may write NULL into.
func (s *Store) writes(table string) (defaulted string, nullable []string) {
	switch table {
	case s.names.Table:
		return "processed_at", []string{"fingerprint", "offset", "partition"}
	case s.names.Attempts:
		return "last_seen", []string{"last_error"}
	}
	return "", nil
}

// hasUniqueKey reports whether table has a primary key or a unique index,
// valid, immediate and without a predicate, on exactly key (in any
// order; INCLUDE columns are not part of it): the ON CONFLICT of the
// statements that write the table relies on it. An index that CREATE
// INDEX CONCURRENTLY left invalid (its build failed or was cancelled)
// enforces nothing and arbitrates no conflict; ON CONFLICT refuses a
// deferrable one.
func hasUniqueKey(ctx context.Context, db DB, table string, key ...string) (bool, error) {
	key = slices.Sorted(slices.Values(key))
	var ok bool
	err := db.QueryRow(ctx, `SELECT EXISTS (
	SELECT 1 FROM pg_index i
	WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indisvalid AND i.indimmediate AND i.indpred IS NULL AND i.indexprs IS NULL
	  AND (SELECT array_agg(a.attname::text ORDER BY a.attname)
	       FROM unnest((i.indkey::int2[])[0:i.indnkeyatts - 1]) AS k(attnum)
	       JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum) = $2::text[])`,
		table, key).Scan(&ok)
	return ok, err
}

// mergingKeys names ("unique index <name>", "exclusion constraint
// <name>") the unique indexes and exclusion constraints of table that can
// take two claims of distinct (consumer, event_id) for one: each is an
// arbiter of the claims' ON CONFLICT, which names no target, and a claim
// that conflicts on such an index reports a duplicate for an id never
// claimed, or finds no row to compare with on every try. Those are the
// indexes whose key holds
// consumer or event_id under a nondeterministic collation (one that
// compares ids case-insensitively, say), and those that lack consumer or
// event_id as columns of their key while every column they read is one the
// store writes (want): an index that reads a column of the user's own (a
// serial id) is left alone.
func mergingKeys(ctx context.Context, db DB, table string, want []pgshape.Want) ([]string, error) {
	written := make([]string, len(want))
	for i, c := range want {
		written[i] = c.Name
	}
	rows, err := db.Query(ctx, `SELECT CASE WHEN i.indisexclusion THEN 'exclusion constraint ' ELSE 'unique index ' END || ic.relname::text
FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid,
LATERAL (
	SELECT count(DISTINCT a.attname) FILTER (WHERE a.attname IN ('consumer', 'event_id')) AS key_cols,
	       bool_or(a.attname IN ('consumer', 'event_id') AND NOT coalesce(c.collisdeterministic, true)) AS folds,
	       coalesce(bool_and(a.attname = ANY($2::text[])), true) AS written
	FROM unnest(i.indkey::int2[], i.indcollation::oid[]) WITH ORDINALITY AS k(attnum, coll, ord)
	JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
	LEFT JOIN pg_collation c ON c.oid = k.coll
	WHERE k.ord <= i.indnkeyatts
) k
WHERE i.indrelid = to_regclass($1) AND (i.indisunique OR i.indisexclusion)
  AND (k.folds OR (k.key_cols < 2 AND k.written AND NOT EXISTS (
	-- the columns its expressions and predicate read
	SELECT 1 FROM pg_depend d JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
	WHERE d.classid = 'pg_class'::regclass AND d.objid = i.indexrelid AND d.refobjid = i.indrelid
	  AND d.refobjsubid > 0 AND a.attname <> ALL($2::text[]))))
ORDER BY 1`, table, written)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// deferrableArbiters names the deferrable unique and exclusion constraints
// of table.
func deferrableArbiters(ctx context.Context, db DB, table string) ([]string, error) {
	rows, err := db.Query(ctx, `SELECT ic.relname::text FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
WHERE i.indrelid = to_regclass($1) AND (i.indisunique OR i.indisexclusion) AND NOT i.indimmediate
ORDER BY 1`, table)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// checkRetentionIndex verifies, at the end of Migrate, that the
// processed-events table has an index on (consumer, processed_at), under
// any name, where another table's index holds the name the migrations give
// it. Index names are per schema and the migrations create them IF
// NOT EXISTS under the table's name with a suffix, so another store's
// index can hold the name: the retention index of a table "billing" is
// the name a store "billing_consumer" gives its index on processed_at
// (version 1). Without this check the migration would create nothing,
// and retention would read the whole table. The same goes for an index of
// the name that a CREATE INDEX CONCURRENTLY left invalid (operations.md
// has it built so, beforehand): the check takes only valid indexes.
func (s *Store) checkRetentionIndex(ctx context.Context, db DB) error {
	var found, invalid bool
	var holder *string // the table that has an index of the name instead
	// The index of the name is looked up in the table's schema, where the
	// migration creates it: with Schema "" the bare name would be found
	// through the search_path, in whichever schema of it has an index of
	// that name first (another store of the table's name, later on the
	// path, when this one's was dropped on purpose).
	err := db.QueryRow(ctx, `WITH t AS (SELECT to_regclass($1) AS rel),
named AS (SELECT to_regclass((SELECT c.relnamespace::regnamespace::text FROM pg_class c WHERE c.oid = t.rel) || '.' || $2) AS idx FROM t)
SELECT
	EXISTS (SELECT 1 FROM pg_index i
		WHERE i.indrelid = to_regclass($1) AND i.indisvalid AND i.indpred IS NULL AND i.indnkeyatts >= 2
		  AND (SELECT array_agg(a.attname::text ORDER BY k.ord)
		       FROM unnest((i.indkey::int2[])[0:1]) WITH ORDINALITY AS k(attnum, ord)
		       JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum) = ARRAY['consumer', 'processed_at']),
	(SELECT i.indrelid::regclass::text FROM pg_index i, named WHERE i.indexrelid = named.idx AND i.indrelid <> to_regclass($1)),
	EXISTS (SELECT 1 FROM pg_index i, named WHERE i.indexrelid = named.idx AND i.indrelid = to_regclass($1) AND NOT i.indisvalid)`,
		s.names.Table, s.names.ConsumerIndex).Scan(&found, &holder, &invalid)
	if err != nil {
		return fmt.Errorf("dedup: checking the indexes of %s: %w", s.names.Table, err)
	}
	if !found && invalid {
		return fmt.Errorf("%w: %s has no valid index on (consumer, processed_at) for retention: %s is invalid "+
			"(a CREATE INDEX CONCURRENTLY that failed, was cancelled, or is still running), and the planner does not use it; "+
			"rebuild it (REINDEX INDEX CONCURRENTLY %s), or drop it and let Migrate create it",
			ErrSchemaMismatch, s.names.Table, s.names.ConsumerIndex, s.names.ConsumerIndexQ)
	}
	if found || holder == nil {
		// An index dropped on purpose (a store without retention) is the
		// user's choice; only a name taken from under the migration is an
		// error.
		return nil
	}
	return fmt.Errorf("%w: %s has no index on (consumer, processed_at) for retention: its name, %s, is taken by an index of %s "+
		"(another store's whose table name starts like this one's); migrate that store first, which frees the name, "+
		"or create an index on %s (consumer, processed_at) under another name",
		ErrSchemaMismatch, s.names.Table, s.names.ConsumerIndex, *holder, s.names.Table)
}
