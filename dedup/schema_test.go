package dedup_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// unversionedSchema is the DDL of the releases before schema versions were
// recorded (their schema.sql.tmpl with the default names), which Migrate
// must recognise as version 1.
const unversionedSchema = `
CREATE TABLE IF NOT EXISTS "processed_events" (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL,
    fingerprint  bytea,
    processed_at timestamptz NOT NULL DEFAULT now(),
    source       text        NOT NULL DEFAULT '',
    partition    integer,
    "offset"     bigint,
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX IF NOT EXISTS "processed_events_processed_at_idx" ON "processed_events" (processed_at);
CREATE TABLE IF NOT EXISTS "processed_events_attempts" (
    consumer  text        NOT NULL,
    event_id  text        NOT NULL,
    attempts  integer     NOT NULL,
    last_seen timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);`

// assertVersion checks the shape of a default-named store at version v
// (0: no tables), and the version recorded.
func assertVersion(t *testing.T, ctx context.Context, pool *pgxpool.Pool, s *dedup.Store, schema string, v int) {
	t.Helper()
	got, err := s.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, v, got, "recorded version")
	var exists bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass('processed_events') IS NOT NULL`).Scan(&exists))
	switch v {
	case 0:
		assert.False(t, exists, "version 0 has no table")
	case 1:
		assert.Equal(t, []string{"processed_at"}, secondaryIndex(t, ctx, pool, schema, "processed_events"))
	case 2:
		assert.Equal(t, []string{"consumer", "processed_at"}, secondaryIndex(t, ctx, pool, schema, "processed_events"))
		assert.NotContains(t, columns(t, ctx, pool, schema, "processed_events_attempts"),
			column{"crashes", "integer", false}, "the crash count comes with version 3")
	case 3:
		assert.Empty(t, columns(t, ctx, pool, schema, "processed_events_offsets"), "the offsets table comes with version 4")
	case 4:
		assert.NotEmpty(t, columns(t, ctx, pool, schema, "processed_events_offsets"))
		assert.NotContains(t, columns(t, ctx, pool, schema, "processed_events_attempts"),
			column{"last_error", "jsonb", true}, "the last error comes with version 5")
	default:
		assertSchema(t, ctx, pool, schema, "processed_events")
	}
}

// From every version, Migrate reaches the newest and keeps the rows; from
// the newest, MigrateTo goes back down to that version, and up again.
func TestMigrateFromEachVersion(t *testing.T) {
	t.Parallel()
	for from := 0; from <= dedup.SchemaVersion; from++ {
		t.Run(fmt.Sprintf("from %d", from), func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			pool, schema := pgtest.Schema(t)
			s, err := dedup.New(dedup.Config{})
			require.NoError(t, err)
			require.NoError(t, s.MigrateTo(ctx, pool, from))
			assertVersion(t, ctx, pool, s, schema, from)
			if from > 0 {
				claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "before"})
			}

			require.NoError(t, s.Migrate(ctx, pool))
			assertVersion(t, ctx, pool, s, schema, dedup.SchemaVersion)
			if from > 0 {
				assert.Equal(t, 1, processed(t, ctx, pool, "c", "before"), "rows survive the migration")
			}
			claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "after"})

			require.NoError(t, s.MigrateTo(ctx, pool, from), "down to %d", from)
			assertVersion(t, ctx, pool, s, schema, from)
			if from > 0 {
				assert.Equal(t, 1, processed(t, ctx, pool, "c", "after"), "rows survive the way down")
			}
			require.NoError(t, s.Migrate(ctx, pool), "up again")
			assertVersion(t, ctx, pool, s, schema, dedup.SchemaVersion)
		})
	}
}

// Tables made by a release that recorded no version are version 1: Migrate
// records that and goes on from there, keeping the rows.
func TestMigrateFromUnversionedSchema(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, schema := pgtest.Schema(t)
	_, err := pool.Exec(ctx, unversionedSchema)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO processed_events (consumer, event_id) VALUES ('c', 'old')`)
	require.NoError(t, err)

	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	assertVersion(t, ctx, pool, s, schema, dedup.SchemaVersion)
	assert.Equal(t, dedup.Duplicate, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "old"}).Outcome)

	var versions []int
	rows, err := pool.Query(ctx, `SELECT version FROM once_schema_versions WHERE component = 'dedup:processed_events' ORDER BY version`)
	require.NoError(t, err)
	versions, err = pgx.CollectRows(rows, pgx.RowTo[int])
	require.NoError(t, err)
	assert.Equal(t, []int{1, 2, 3, 4, 5}, versions)
}

// An unversioned processed_events table without its attempts table (made
// by hand from an old file) gets the attempts table; its rows stay.
func TestMigrateAddsMissingAttemptsTable(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, schema := pgtest.Schema(t)
	_, err := pool.Exec(ctx, unversionedSchema+`DROP TABLE processed_events_attempts;
INSERT INTO processed_events (consumer, event_id) VALUES ('c', 'old');`)
	require.NoError(t, err)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	assertVersion(t, ctx, pool, s, schema, dedup.SchemaVersion)
	assert.Equal(t, 1, processed(t, ctx, pool, "c", "old"))
}

// The plain files for golang-migrate, applied by hand, make the same
// tables; a store then migrates over them (recording their versions).
func TestMigrationFilesCreateSameSchema(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, schema := pgtest.Schema(t)
	files, err := filepath.Glob("migrations/golang-migrate/*.up.sql")
	require.NoError(t, err)
	require.Len(t, files, dedup.SchemaVersion)
	for _, f := range files { // Glob sorts: 001, 002, …
		sql, err := os.ReadFile(f)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, string(sql))
		require.NoError(t, err, f)
	}
	assertSchema(t, ctx, pool, schema, "processed_events")

	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, s.Check(ctx, pool))
	require.NoError(t, s.Migrate(ctx, pool))
	assertVersion(t, ctx, pool, s, schema, dedup.SchemaVersion)
	assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "1"}).Outcome)
}

// A database migrated by a newer release is refused, and left as it is.
func TestMigrateRefusesNewerSchema(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	newer := dedup.SchemaVersion + 1
	_, err = pool.Exec(ctx, `INSERT INTO once_schema_versions (component, version, name) VALUES ('dedup:processed_events', $1, 'future')`, newer)
	require.NoError(t, err)

	err = s.Migrate(ctx, pool)
	require.ErrorIs(t, err, dedup.ErrSchemaNewer)
	assert.Contains(t, err.Error(), fmt.Sprintf("version %d", newer))
	require.ErrorIs(t, s.MigrateTo(ctx, pool, 0), dedup.ErrSchemaNewer, "not even down")
	v, err := s.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, newer, v)
	require.Error(t, s.MigrateTo(ctx, pool, dedup.SchemaVersion+1), "a version the code does not know")
	require.Error(t, s.MigrateTo(ctx, pool, -1))
}

// Stores with different tables in one schema keep versions of their own.
func TestVersionsPerTable(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	a, err := dedup.New(dedup.Config{Table: "a"})
	require.NoError(t, err)
	b, err := dedup.New(dedup.Config{Table: "b"})
	require.NoError(t, err)
	require.NoError(t, a.Migrate(ctx, pool))
	require.NoError(t, b.MigrateTo(ctx, pool, 1))
	va, err := a.Version(ctx, pool)
	require.NoError(t, err)
	vb, err := b.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, []int{dedup.SchemaVersion, 1}, []int{va, vb})
}

// A processed_events table of another shape (another library's, or made
// by hand) fails Migrate and Check with an error naming what differs,
// before anything is changed, instead of failing every claim later.
func TestAnotherShapeFailsFast(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		ddl   string
		diffs []string
	}{{
		name: "another library's table",
		ddl: `CREATE TABLE processed_events (
    id           bigserial PRIMARY KEY,
    handler_name text NOT NULL,
    message_uuid uuid NOT NULL,
    processed_at timestamp NOT NULL DEFAULT now()
)`,
		diffs: []string{
			"column consumer (text) is missing",
			"column event_id (text) is missing",
			"column processed_at is timestamp without time zone, want timestamp with time zone",
			"column handler_name is NOT NULL without a default",
			"column message_uuid is NOT NULL without a default",
			"no primary key or unique index on (consumer, event_id)",
		},
	}, {
		name: "other types",
		ddl: `CREATE TABLE processed_events (
    consumer     integer     NOT NULL,
    event_id     uuid        NOT NULL,
    fingerprint  bytea,
    processed_at timestamptz NOT NULL DEFAULT now(),
    source       text        NOT NULL DEFAULT '',
    partition    integer,
    "offset"     integer,
    PRIMARY KEY (consumer, event_id)
)`,
		diffs: []string{
			"column consumer is integer, want text",
			"column event_id is uuid, want text",
			"column offset is integer, want bigint",
		},
	}, {
		name: "no key on (consumer, event_id)",
		ddl: `CREATE TABLE processed_events (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL PRIMARY KEY,
    fingerprint  bytea,
    processed_at timestamptz NOT NULL DEFAULT now(),
    source       text        NOT NULL DEFAULT '',
    partition    integer,
    "offset"     bigint
)`,
		diffs: []string{"no primary key or unique index on (consumer, event_id)"},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			pool, _ := pgtest.Schema(t)
			_, err := pool.Exec(ctx, tc.ddl)
			require.NoError(t, err)
			s, err := dedup.New(dedup.Config{})
			require.NoError(t, err)

			for what, err := range map[string]error{"Check": s.Check(ctx, pool), "Migrate": s.Migrate(ctx, pool)} {
				require.ErrorIs(t, err, dedup.ErrSchemaMismatch, what)
				assert.Contains(t, err.Error(), `"processed_events"`, what)
				for _, d := range tc.diffs {
					assert.Contains(t, err.Error(), d, what)
				}
			}
			var attempts bool
			require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass('processed_events_attempts') IS NOT NULL`).Scan(&attempts))
			assert.False(t, attempts, "a failed Migrate changes nothing")
		})
	}
}

func TestCheck(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)

	err = s.Check(ctx, pool)
	require.ErrorIs(t, err, dedup.ErrSchemaMismatch)
	assert.Contains(t, err.Error(), `"processed_events" does not exist`)
	assert.Contains(t, err.Error(), `"processed_events_attempts" does not exist`)

	require.NoError(t, s.Migrate(ctx, pool))
	require.NoError(t, s.Check(ctx, pool))

	// Columns of the user's own are fine when an insert can leave them out.
	_, err = pool.Exec(ctx, `ALTER TABLE processed_events ADD COLUMN note text, ADD COLUMN tenant text NOT NULL DEFAULT 'x'`)
	require.NoError(t, err)
	require.NoError(t, s.Check(ctx, pool))
	_, err = pool.Exec(ctx, `ALTER TABLE processed_events_attempts DROP COLUMN last_seen`)
	require.NoError(t, err)
	err = s.Check(ctx, pool)
	require.ErrorIs(t, err, dedup.ErrSchemaMismatch)
	assert.Contains(t, err.Error(), "column last_seen (timestamp with time zone) is missing")
	assert.Contains(t, err.Error(), `"processed_events_attempts"`)
	assert.False(t, strings.Contains(err.Error(), `"processed_events" is not`), "only the table that differs is named: %v", err)
}

// A service whose database user may only read and write rows starts on a
// schema an administrator migrated: Migrate at the newest version creates
// nothing, so it needs no CREATE privilege.
func TestMigrateNeedsNoCreatePrivilegeOnceMigrated(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, schema := pgtest.Schema(t)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))

	role := pgx.Identifier{"rw_" + schema}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE ROLE `+role+` NOLOGIN`); err != nil {
		t.Skipf("cannot create a role on this server: %v", err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = pool.Exec(context.Background(), `DROP ROLE `+role)
	})
	sch := pgx.Identifier{schema}.Sanitize()
	_, err = pool.Exec(ctx, `GRANT USAGE ON SCHEMA `+sch+` TO `+role+`;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA `+sch+` TO `+role)
	require.NoError(t, err)

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	defer conn.Exec(context.Background(), `RESET ROLE`) //nolint:errcheck // the connection goes back to the pool
	_, err = conn.Exec(ctx, `SET ROLE `+role)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `CREATE TABLE probe (id int)`)
	require.Error(t, err, "the role must not be able to create tables")

	require.NoError(t, s.Migrate(ctx, conn.Conn()), "Migrate at the newest version creates nothing")
	require.NoError(t, s.Check(ctx, conn))
	assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "1"}).Outcome)
}

// A unique index is the arbiter of every claim's ON CONFLICT: one that
// takes two distinct ids (or the same id of two consumers) for one would
// report an id never committed as a duplicate, or fail its claim on every
// try. Check refuses such a table, made by other tools, before any claim.
func TestCheckRefusesAKeyThatTakesDistinctIDsForOne(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, ddl, table, diff string
	}{{
		name:  "case-insensitive event_id",
		ddl:   `ALTER TABLE processed_events ALTER COLUMN event_id TYPE text COLLATE ci`,
		table: `"processed_events"`,
		diff:  `unique index processed_events_pkey`,
	}, {
		name:  "case-insensitive unique index",
		ddl:   `CREATE UNIQUE INDEX events_ci ON processed_events (consumer, event_id COLLATE ci)`,
		table: `"processed_events"`,
		diff:  `unique index events_ci`,
	}, {
		name:  "unique event_id across consumers",
		ddl:   `CREATE UNIQUE INDEX events_any_consumer ON processed_events (event_id)`,
		table: `"processed_events"`,
		diff:  `unique index events_any_consumer`,
	}, {
		name:  "unique lower(event_id)",
		ddl:   `CREATE UNIQUE INDEX events_lower ON processed_events (consumer, lower(event_id))`,
		table: `"processed_events"`,
		diff:  `unique index events_lower`,
	}, {
		name:  "case-insensitive attempts",
		ddl:   `ALTER TABLE processed_events_attempts ALTER COLUMN event_id TYPE text COLLATE ci`,
		table: `"processed_events_attempts"`,
		diff:  `unique index processed_events_attempts_pkey`,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, pool, s := setup(t)
			_, err := pool.Exec(ctx, `CREATE COLLATION ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)`)
			if err != nil {
				t.Skipf("no ICU collations on this server: %v", err)
			}
			_, err = pool.Exec(ctx, tc.ddl)
			require.NoError(t, err)

			for what, err := range map[string]error{"Check": s.Check(ctx, pool), "Migrate": s.Migrate(ctx, pool)} {
				require.ErrorIs(t, err, dedup.ErrSchemaMismatch, what)
				assert.Contains(t, err.Error(), tc.table, what)
				assert.Contains(t, err.Error(), tc.diff, what)
			}
		})
	}

	// Unique indexes that read a column the store does not write cannot
	// take two claims for one.
	ctx, pool, s := setup(t)
	_, err := pool.Exec(ctx, `ALTER TABLE processed_events ADD COLUMN id bigserial;
CREATE UNIQUE INDEX events_id ON processed_events (id);
CREATE UNIQUE INDEX events_id_lower ON processed_events (lower(event_id), id);
CREATE UNIQUE INDEX events_tenant ON processed_events (consumer, event_id, source)`)
	require.NoError(t, err)
	require.NoError(t, s.Check(ctx, pool))

	// What such a key does: an id never committed is a duplicate.
	ctx, pool, s = setup(t)
	_, err = pool.Exec(ctx, `CREATE COLLATION ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)`)
	if err != nil {
		t.Skipf("no ICU collations on this server: %v", err)
	}
	_, err = pool.Exec(ctx, `ALTER TABLE processed_events ALTER COLUMN event_id TYPE text COLLATE ci`)
	require.NoError(t, err)
	require.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "Evt-1"}).Outcome)
	require.Equal(t, dedup.Duplicate, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "evt-1"}).Outcome,
		"evt-1 was never claimed")
	require.Error(t, s.Check(ctx, pool))
}

// A store whose offsets table is another store's processed-events table
// ("billing" beside "billing_offsets") is refused by Migrate: its version
// 4 would otherwise skip creating the table, and going back down from it
// would drop the other store's rows with the table.
func TestMigrateRefusesAnOffsetsTableOfAnotherShape(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	other, err := dedup.New(dedup.Config{Table: "billing_offsets"})
	require.NoError(t, err)
	require.NoError(t, other.Migrate(ctx, pool))
	c := dedup.Claim{Consumer: "c", EventID: "evt-1"}
	require.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, other, c).Outcome)

	s, err := dedup.New(dedup.Config{Table: "billing"})
	require.NoError(t, err)
	err = s.Migrate(ctx, pool)
	require.ErrorIs(t, err, dedup.ErrSchemaMismatch)
	assert.Contains(t, err.Error(), `"billing_offsets"`)
	v, err := s.Version(ctx, pool)
	require.NoError(t, err)
	assert.Zero(t, v, "nothing migrated")

	assert.Equal(t, dedup.Duplicate, claimTx(t, ctx, pool, other, c).Outcome, "the other store's rows are kept")
}

// Index names are the table's name with a suffix, and PostgreSQL names
// indexes per schema: the retention index of a store "billing" (version
// 2), billing_consumer_processed_at_idx, is the name a store
// "billing_consumer" gives its index on processed_at at version 1. Going
// up, billing's CREATE INDEX IF NOT EXISTS found that other index and
// created none, then dropped its own old one: billing was left with no
// index for retention, which then read the whole table, and no error.
// Migrate now refuses, naming the index, and changes nothing; once the
// other store is migrated (freeing the name), it succeeds.
func TestMigrateRefusesARetentionIndexNameTakenByAnotherStore(t *testing.T) {
	ctx := testCtx(t)
	pool, schema := pgtest.Schema(t)
	billing, err := dedup.New(dedup.Config{Table: "billing"})
	require.NoError(t, err)
	other, err := dedup.New(dedup.Config{Table: "billing_consumer"})
	require.NoError(t, err)
	require.NoError(t, billing.MigrateTo(ctx, pool, 1))
	require.NoError(t, other.MigrateTo(ctx, pool, 1))

	err = billing.Migrate(ctx, pool)
	require.ErrorIs(t, err, dedup.ErrSchemaMismatch)
	assert.Contains(t, err.Error(), "billing_consumer_processed_at_idx")
	assert.Equal(t, []string{"billing_pkey", "billing_processed_at_idx"}, indexes(t, ctx, pool, schema, "billing"),
		"nothing changed")

	require.NoError(t, other.Migrate(ctx, pool))
	require.NoError(t, billing.Migrate(ctx, pool))
	assertSchema(t, ctx, pool, schema, "billing")
	assertSchema(t, ctx, pool, schema, "billing_consumer")
	assert.Equal(t, []string{"billing_consumer_processed_at_idx", "billing_pkey"}, indexes(t, ctx, pool, schema, "billing"))
}

// indexes names table's indexes, sorted.
func indexes(t *testing.T, ctx context.Context, db dedup.DB, schema, table string) []string {
	t.Helper()
	rows, err := db.Query(ctx, `SELECT indexname::text FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 ORDER BY 1`, schema, table)
	require.NoError(t, err)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return names
}

// A unique index that CREATE UNIQUE INDEX CONCURRENTLY left invalid (its
// build failed: the table held a duplicate, or it was cancelled) enforces
// nothing and is no arbiter of ON CONFLICT: with no other key, the same id
// is claimed twice. Check and Migrate refuse such a table, on each of the
// three tables' keys.
func TestCheckRefusesAnInvalidKey(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		table, key string
		check      func(*dedup.Store, context.Context, dedup.DB) error
	}{
		{"processed_events", "consumer, event_id", (*dedup.Store).Check},
		{"processed_events_attempts", "consumer, event_id", (*dedup.Store).Check},
		{"processed_events_offsets", "consumer, topic, partition", (*dedup.Store).CheckOffsets},
	} {
		t.Run(tc.table, func(t *testing.T) {
			t.Parallel()
			ctx, pool, s := setup(t)
			_, err := pool.Exec(ctx, `ALTER TABLE `+tc.table+` DROP CONSTRAINT `+tc.table+`_pkey`)
			require.NoError(t, err)
			makeInvalidUniqueIndex(t, ctx, pool, tc.table, tc.key)

			for what, err := range map[string]error{"Check": tc.check(s, ctx, pool), "Migrate": s.Migrate(ctx, pool)} {
				require.ErrorIs(t, err, dedup.ErrSchemaMismatch, what)
				assert.Contains(t, err.Error(), "no primary key or unique index on ("+tc.key+")", what)
			}
		})
	}

	// What such a key does: the same id is claimed twice.
	ctx, pool, s := setup(t)
	_, err := pool.Exec(ctx, `ALTER TABLE processed_events DROP CONSTRAINT processed_events_pkey`)
	require.NoError(t, err)
	makeInvalidUniqueIndex(t, ctx, pool, "processed_events", "consumer, event_id")
	c := dedup.Claim{Consumer: "c", EventID: "evt-1"}
	require.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, c).Outcome)
	require.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, c).Outcome, "claimed again: the index enforces nothing")
}

// makeInvalidUniqueIndex leaves on table, empty, an invalid unique index
// on key, as a CREATE UNIQUE INDEX CONCURRENTLY that meets a duplicate
// does.
func makeInvalidUniqueIndex(t *testing.T, ctx context.Context, pool *pgxpool.Pool, table, key string) {
	t.Helper()
	row := map[string]string{
		"processed_events":          `(consumer, event_id) VALUES ('x', 'd')`,
		"processed_events_attempts": `(consumer, event_id, attempts) VALUES ('x', 'd', 1)`,
		"processed_events_offsets":  `(consumer, topic, partition) VALUES ('x', 't', 0)`,
	}[table]
	_, err := pool.Exec(ctx, `INSERT INTO `+table+` `+row+`, `+row[strings.Index(row, "VALUES")+len("VALUES "):])
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE UNIQUE INDEX CONCURRENTLY key_idx ON `+table+` (`+key+`)`)
	require.Error(t, err, "the build meets the duplicate")
	var valid bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT indisvalid FROM pg_index WHERE indexrelid = 'key_idx'::regclass`).Scan(&valid))
	require.False(t, valid)
	_, err = pool.Exec(ctx, `DELETE FROM `+table)
	require.NoError(t, err)
}

// ON CONFLICT cannot use a deferrable unique constraint: as the key of a
// table it leaves every claim, crash-guard record or take-over failing;
// on processed_events, whose claims name no conflict target, any
// deferrable unique or exclusion constraint does, whatever its columns.
// Check and Migrate refuse such a table instead.
func TestCheckRefusesADeferrableKey(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, ddl, diff string
		check           func(*dedup.Store, context.Context, dedup.DB) error
	}{{
		name: "processed_events key",
		ddl: `ALTER TABLE processed_events DROP CONSTRAINT processed_events_pkey;
ALTER TABLE processed_events ADD PRIMARY KEY (consumer, event_id) DEFERRABLE INITIALLY DEFERRED`,
		diff:  "no primary key or unique index on (consumer, event_id)",
		check: (*dedup.Store).Check,
	}, {
		name: "attempts key",
		ddl: `ALTER TABLE processed_events_attempts DROP CONSTRAINT processed_events_attempts_pkey;
ALTER TABLE processed_events_attempts ADD PRIMARY KEY (consumer, event_id) DEFERRABLE`,
		diff:  "no primary key or unique index on (consumer, event_id)",
		check: (*dedup.Store).Check,
	}, {
		name: "offsets key",
		ddl: `ALTER TABLE processed_events_offsets DROP CONSTRAINT processed_events_offsets_pkey;
ALTER TABLE processed_events_offsets ADD PRIMARY KEY (consumer, topic, partition) DEFERRABLE`,
		diff:  "no primary key or unique index on (consumer, topic, partition)",
		check: (*dedup.Store).CheckOffsets,
	}, {
		name: "a column of the user's own",
		ddl: `ALTER TABLE processed_events ADD COLUMN seq bigserial;
ALTER TABLE processed_events ADD CONSTRAINT events_seq UNIQUE (seq) DEFERRABLE`,
		diff:  "events_seq is deferrable",
		check: (*dedup.Store).Check,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, pool, s := setup(t)
			_, err := pool.Exec(ctx, tc.ddl)
			require.NoError(t, err)

			for what, err := range map[string]error{"Check": tc.check(s, ctx, pool), "Migrate": s.Migrate(ctx, pool)} {
				require.ErrorIs(t, err, dedup.ErrSchemaMismatch, what)
				assert.Contains(t, err.Error(), tc.diff, what)
			}
		})
	}

	// A deferrable constraint of the user's on the attempts table is
	// fine: the crash guard names its conflict target.
	ctx, pool, s := setup(t)
	_, err := pool.Exec(ctx, `ALTER TABLE processed_events_attempts ADD COLUMN seq bigserial;
ALTER TABLE processed_events_attempts ADD CONSTRAINT attempts_seq UNIQUE (seq) DEFERRABLE`)
	require.NoError(t, err)
	require.NoError(t, s.Check(ctx, pool))

	// What such a constraint does: every claim fails.
	ctx, pool, s = setup(t)
	_, err = pool.Exec(ctx, `ALTER TABLE processed_events ADD COLUMN seq bigserial;
ALTER TABLE processed_events ADD CONSTRAINT events_seq UNIQUE (seq) DEFERRABLE`)
	require.NoError(t, err)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	_, err = s.Claim(ctx, tx, dedup.Claim{Consumer: "c", EventID: "evt-1"})
	require.ErrorContains(t, err, "deferrable")
}

// Operations says to build version 2's index beforehand with CREATE INDEX
// CONCURRENTLY under its name. A build that did not finish (cancelled, or
// timed out waiting for the transactions in progress) leaves the name to
// an invalid index, which the planner never uses: version 2's CREATE INDEX
// IF NOT EXISTS took it for the index and dropped the old one, leaving
// retention to read the whole table. Migrate now refuses, saying so, and
// changes nothing; once the index is built, it succeeds.
func TestMigrateRefusesAnInvalidRetentionIndex(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, schema := pgtest.Schema(t)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, s.MigrateTo(ctx, pool, 1))

	// A writer's transaction in progress: the concurrent build waits for
	// it, and its statement_timeout cuts it short.
	writer, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer writer.Rollback(ctx) //nolint:errcheck
	_, err = writer.Exec(ctx, `INSERT INTO processed_events (consumer, event_id) VALUES ('c', 'evt-1')`)
	require.NoError(t, err)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `SET statement_timeout = '200ms'`)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `CREATE INDEX CONCURRENTLY processed_events_consumer_processed_at_idx ON processed_events (consumer, processed_at)`)
	require.Error(t, err, "the build is cut short")
	_, err = conn.Exec(ctx, `RESET statement_timeout`)
	require.NoError(t, err)
	conn.Release()
	require.NoError(t, writer.Rollback(ctx))

	err = s.Migrate(ctx, pool)
	require.ErrorIs(t, err, dedup.ErrSchemaMismatch)
	assert.Contains(t, err.Error(), "processed_events_consumer_processed_at_idx")
	assert.Contains(t, err.Error(), "invalid")
	v, err := s.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, 1, v, "nothing migrated")
	assert.Equal(t, []string{"processed_events_consumer_processed_at_idx", "processed_events_pkey", "processed_events_processed_at_idx"},
		indexes(t, ctx, pool, schema, "processed_events"), "the old index is kept")

	_, err = pool.Exec(ctx, `REINDEX INDEX processed_events_consumer_processed_at_idx`)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	assertSchema(t, ctx, pool, schema, "processed_events")
}

// Services that share a database each keep their tables in a schema of
// their own, first on their search_path, with a common schema after it
// (public): Config.Schema is "". A schema version is recorded in the
// schema of the store's tables (operations.md), so each service's tables
// are migrated, whatever the common schema holds: the version table that
// another component created there was taken for the store's, the first
// service's versions recorded in it, and the second service, finding its
// tables recorded at the newest version, created none and could not
// start.
func TestMigrateRecordsVersionsBesideTheTablesOnTheSearchPath(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	common, pub := pgtest.Schema(t)
	_, a := pgtest.Schema(t)
	_, b := pgtest.Schema(t)
	// Another component's versions in the common schema.
	other, err := dedup.New(dedup.Config{Table: "audit"})
	require.NoError(t, err)
	require.NoError(t, other.Migrate(ctx, common))

	for _, svc := range []string{a, b} {
		pool := pgtest.NewPool(t, svc+", "+pub)
		s, err := dedup.New(dedup.Config{})
		require.NoError(t, err)
		require.NoError(t, s.Migrate(ctx, pool), svc)
		assertSchema(t, ctx, pool, svc, "processed_events")
		v, err := s.Version(ctx, pool)
		require.NoError(t, err)
		assert.Equal(t, dedup.SchemaVersion, v)
		assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "1"}).Outcome, svc)
		assert.Equal(t, 1, rowCount(t, ctx, pool, `SELECT count(*) FROM `+pgx.Identifier{svc, "once_schema_versions"}.Sanitize()+
			` WHERE component = 'dedup:processed_events' AND version = 4`), "recorded beside %s's tables", svc)
	}

	// Versions that an earlier release recorded in the common schema, for
	// tables in the service's, are still read there.
	_, c := pgtest.Schema(t)
	pool := pgtest.NewPool(t, c+", "+pub)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, s.SchemaSQL())
	require.NoError(t, err)
	_, err = common.Exec(ctx, `INSERT INTO once_schema_versions (component, version, name)
SELECT 'dedup:processed_events', v, 'v' || v FROM generate_series(1, 4) v`)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	v, err := s.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, dedup.SchemaVersion, v)
	var beside bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`,
		pgx.Identifier{c, "once_schema_versions"}.Sanitize()).Scan(&beside))
	assert.False(t, beside, "the versions recorded in the common schema are used")
}

// A key with INCLUDE columns (for index-only scans of the fingerprint,
// say) is the key all the same: its key columns are what ON CONFLICT
// matches. Check and CheckOffsets took the included columns for part of
// the key, and refused the table.
func TestCheckAcceptsAKeyWithIncludedColumns(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	_, err := pool.Exec(ctx, `ALTER TABLE processed_events DROP CONSTRAINT processed_events_pkey;
ALTER TABLE processed_events ADD PRIMARY KEY (consumer, event_id) INCLUDE (fingerprint);
ALTER TABLE processed_events_offsets DROP CONSTRAINT processed_events_offsets_pkey;
ALTER TABLE processed_events_offsets ADD PRIMARY KEY (consumer, topic, partition) INCLUDE (epoch)`)
	require.NoError(t, err)
	require.NoError(t, s.Check(ctx, pool))
	require.NoError(t, s.CheckOffsets(ctx, pool))
	require.NoError(t, s.Migrate(ctx, pool))

	c := dedup.Claim{Consumer: "c", EventID: "evt-1"}
	assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, c).Outcome)
	assert.Equal(t, dedup.Duplicate, claimTx(t, ctx, pool, s, c).Outcome)
	assert.Equal(t, int64(-1), takeOver(t, ctx, pool, s, "").Next)
}
