package dedup_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// testCtx bounds every database call of a test, so that a lock wait that
// never ends fails the test instead of hanging the binary.
func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// setup returns a pool on a fresh schema of the test's own and a store
// whose tables are migrated in it.
func setup(t testing.TB) (context.Context, *pgxpool.Pool, *dedup.Store) {
	t.Helper()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	return ctx, pool, s
}

// claimTx claims c in a transaction of its own and commits it.
func claimTx(t testing.TB, ctx context.Context, pool *pgxpool.Pool, s *dedup.Store, c dedup.Claim) dedup.Result {
	t.Helper()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	r, err := s.Claim(ctx, tx, c)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	return r
}

func rowCount(t testing.TB, ctx context.Context, db dedup.DB, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(ctx, sql, args...).Scan(&n))
	return n
}

func processed(t testing.TB, ctx context.Context, db dedup.DB, consumer, id string) int {
	t.Helper()
	return rowCount(t, ctx, db, `SELECT count(*) FROM processed_events WHERE consumer = $1 AND event_id = $2`, consumer, id)
}

// countingDB counts the statements a store sends through it.
type countingDB struct {
	dedup.DB
	n     atomic.Int64
	after func(n int64) // called after each statement, if set
}

func (c *countingDB) count() {
	n := c.n.Add(1)
	if c.after != nil {
		c.after(n)
	}
}

func (c *countingDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	defer c.count()
	return c.DB.Exec(ctx, sql, args...)
}

func (c *countingDB) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	defer c.count()
	return c.DB.Query(ctx, sql, args...) //nolint:sqlclosecheck // a pass-through: its caller closes the rows
}

func (c *countingDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	defer c.count()
	return c.DB.QueryRow(ctx, sql, args...)
}

// --- schema ---------------------------------------------------------------

type column struct {
	Name, Type string
	Nullable   bool
}

func columns(t testing.TB, ctx context.Context, db dedup.DB, schema, table string) []column {
	t.Helper()
	rows, err := db.Query(ctx, `SELECT column_name, data_type, is_nullable = 'YES'
FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2 ORDER BY ordinal_position`, schema, table)
	require.NoError(t, err)
	var cols []column
	var c column
	_, err = pgx.ForEachRow(rows, []any{&c.Name, &c.Type, &c.Nullable}, func() error {
		cols = append(cols, c)
		return nil
	})
	require.NoError(t, err)
	return cols
}

func primaryKey(t testing.TB, ctx context.Context, db dedup.DB, schema, table string) []string {
	t.Helper()
	var key []string
	require.NoError(t, db.QueryRow(ctx, `SELECT coalesce(array_agg(a.attname::text ORDER BY k.ord), '{}')
FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indisprimary AND i.indrelid = to_regclass(quote_ident($1) || '.' || quote_ident($2))`,
		schema, table).Scan(&key))
	return key
}

// assertSchema checks the tables, keys and index of a store with the given
// table name in schema.
func assertSchema(t testing.TB, ctx context.Context, db dedup.DB, schema, table string) {
	t.Helper()
	assert.Equal(t, []column{
		{"consumer", "text", false},
		{"event_id", "text", false},
		{"fingerprint", "bytea", true},
		{"processed_at", "timestamp with time zone", false},
		{"source", "text", false},
		{"partition", "integer", true},
		{"offset", "bigint", true},
	}, columns(t, ctx, db, schema, table))
	assert.Equal(t, []column{
		{"consumer", "text", false},
		{"event_id", "text", false},
		{"attempts", "integer", false},
		{"last_seen", "timestamp with time zone", false},
		{"crashes", "integer", false},
		{"last_error", "jsonb", true},
	}, columns(t, ctx, db, schema, table+"_attempts"))
	assert.Equal(t, []column{
		{"consumer", "text", false},
		{"topic", "text", false},
		{"partition", "integer", false},
		{"next_offset", "bigint", false},
		{"done", "ARRAY", false},
		{"epoch", "bigint", false},
		{"topic_id", "text", false},
		{"kafka_group", "text", false},
		{"generation", "integer", false},
		{"updated_at", "timestamp with time zone", false},
	}, columns(t, ctx, db, schema, table+"_offsets"))
	assert.Equal(t, []string{"consumer", "event_id"}, primaryKey(t, ctx, db, schema, table))
	assert.Equal(t, []string{"consumer", "event_id"}, primaryKey(t, ctx, db, schema, table+"_attempts"))
	assert.Equal(t, []string{"consumer", "topic", "partition"}, primaryKey(t, ctx, db, schema, table+"_offsets"))
	assert.Equal(t, []string{"consumer", "processed_at"}, secondaryIndex(t, ctx, db, schema, table),
		"%s.%s needs an index on (consumer, processed_at) for retention", schema, table)
}

// secondaryIndex returns the columns, in order, of the indexes of table
// that are not its primary key.
func secondaryIndex(t testing.TB, ctx context.Context, db dedup.DB, schema, table string) []string {
	t.Helper()
	var indexed []string
	require.NoError(t, db.QueryRow(ctx, `SELECT coalesce(array_agg(a.attname::text ORDER BY i.indexrelid, k.ord), '{}')
FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE NOT i.indisprimary AND i.indrelid = to_regclass(quote_ident($1) || '.' || quote_ident($2))`,
		schema, table).Scan(&indexed))
	return indexed
}

func TestMigrateIsIdempotent(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, schema := pgtest.Schema(t)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)

	require.NoError(t, s.Migrate(ctx, pool))
	claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "kept"})
	require.NoError(t, s.Migrate(ctx, pool), "second Migrate")

	assertSchema(t, ctx, pool, schema, "processed_events")
	assert.Equal(t, 1, processed(t, ctx, pool, "c", "kept"), "a second Migrate keeps the rows")
}

func TestMigrateConcurrent(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, schema := pgtest.Schema(t)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)

	const n = 4
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			errs[i] = s.Migrate(ctx, pool)
		})
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "Migrate #%d", i)
	}
	assertSchema(t, ctx, pool, schema, "processed_events")
}

// --- configuration ----------------------------------------------------------

func TestConfigRejectsInvalidNames(t *testing.T) {
	t.Parallel()
	bad := []string{
		"a;drop table x",
		`"quoted"`,
		"with space",
		" leading",
		"trailing ",
		"with-dash",
		"1starts_with_digit",
		"schema.table",
		"new\nline",
		"trailing_newline\n",
		"tab\there",
		"événements",
		"nul\x00byte",
		"a'b",
		strings.Repeat("a", 49),
		strings.Repeat("x", 200),
	}
	for _, name := range bad {
		t.Run(fmt.Sprintf("Table=%q", name), func(t *testing.T) {
			t.Parallel()
			s, err := dedup.New(dedup.Config{Table: name})
			require.ErrorIs(t, err, dedup.ErrInvalidName)
			assert.Nil(t, s)
			assert.Contains(t, err.Error(), "Table")
			assert.NotContains(t, err.Error(), "Schema")
		})
		t.Run(fmt.Sprintf("Schema=%q", name), func(t *testing.T) {
			t.Parallel()
			s, err := dedup.New(dedup.Config{Schema: name})
			require.ErrorIs(t, err, dedup.ErrInvalidName)
			assert.Nil(t, s)
			assert.Contains(t, err.Error(), "Schema")
			assert.NotContains(t, err.Error(), "Table")
		})
	}
}

func TestConfigAcceptsValidNames(t *testing.T) {
	t.Parallel()
	for _, cfg := range []dedup.Config{
		{},
		{Schema: ""},
		{Table: "events"},
		{Schema: "public", Table: "processed_events"},
		{Schema: "_s", Table: "_t"},
		{Schema: "Mixed_Case9", Table: "T1"},
		{Schema: strings.Repeat("s", 48), Table: strings.Repeat("t", 48)},
	} {
		t.Run(fmt.Sprintf("%+v", cfg), func(t *testing.T) {
			t.Parallel()
			s, err := dedup.New(cfg)
			require.NoError(t, err)
			require.NotNil(t, s)
			table := cfg.Table
			if table == "" {
				table = dedup.DefaultTable
			}
			want := `"` + table + `"`
			if cfg.Schema != "" {
				want = `"` + cfg.Schema + `".` + want
			}
			assert.Contains(t, s.SchemaSQL(), "CREATE TABLE IF NOT EXISTS "+want+" (")
		})
	}
}

// A name that is an SQL keyword is valid, and works, because names are quoted.
func TestReservedWordTableName(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, schema := pgtest.Schema(t)
	s, err := dedup.New(dedup.Config{Table: "select"})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	assertSchema(t, ctx, pool, schema, "select")
	assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "1"}).Outcome)
	assert.Equal(t, dedup.Duplicate, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "1"}).Outcome)
}

func TestSchemaQualifiesTables(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, home := pgtest.Schema(t) // the pool's search_path
	_, other := pgtest.Schema(t)   // where the store's tables go
	require.LessOrEqual(t, len(other), 48, "test schema name too long for a Config.Schema")

	s, err := dedup.New(dedup.Config{Schema: other, Table: "seen"})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	require.NoError(t, s.Migrate(ctx, pool))

	assertSchema(t, ctx, pool, other, "seen")
	var inHome *string
	require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass('seen')::text`).Scan(&inHome))
	assert.Nil(t, inHome, "no table in the search_path schema %s", home)

	c := dedup.Claim{Consumer: "c", EventID: "e1", Fingerprint: []byte{1}}
	assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, c).Outcome)
	assert.Equal(t, dedup.Duplicate, claimTx(t, ctx, pool, s, c).Outcome)
	c.Fingerprint = []byte{2}
	assert.Equal(t, dedup.Conflict, claimTx(t, ctx, pool, s, c).Outcome)
	assert.Equal(t, 1, rowCount(t, ctx, pool, `SELECT count(*) FROM `+pgx.Identifier{other, "seen"}.Sanitize()))

	seedAttempt(t, ctx, pool, s.AttemptsTable(), "c", "e2")
	assert.Equal(t, 1, rowCount(t, ctx, pool, `SELECT count(*) FROM `+pgx.Identifier{other, "seen_attempts"}.Sanitize()))

	_, err = pool.Exec(ctx, `UPDATE `+pgx.Identifier{other, "seen"}.Sanitize()+` SET processed_at = now() - interval '1 hour'`)
	require.NoError(t, err)
	deleted, err := s.DeleteOlderThan(ctx, pool, "c", time.Now().Add(-time.Minute), 0)
	require.NoError(t, err)
	assert.Equal(t, int64(1), deleted)
}

// --- Claim ------------------------------------------------------------------

func TestClaimNewIDVisibleOnlyAfterCommit(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	c := dedup.Claim{Consumer: "orders", EventID: "evt-1", Fingerprint: []byte("fp")}

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	r, err := s.Claim(ctx, tx, c)
	require.NoError(t, err)
	assert.Equal(t, dedup.Claimed, r.Outcome)
	assert.Equal(t, dedup.Previous{}, r.Previous)
	assert.Equal(t, 1, processed(t, ctx, tx, "orders", "evt-1"), "visible inside the claiming tx")
	assert.Equal(t, 0, processed(t, ctx, pool, "orders", "evt-1"), "invisible outside before commit")
	require.NoError(t, tx.Commit(ctx))
	assert.Equal(t, 1, processed(t, ctx, pool, "orders", "evt-1"), "visible after commit")
}

func TestClaimRolledBackLeavesNoRow(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	c := dedup.Claim{Consumer: "orders", EventID: "evt-1"}

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	r, err := s.Claim(ctx, tx, c)
	require.NoError(t, err)
	require.Equal(t, dedup.Claimed, r.Outcome)
	require.NoError(t, tx.Rollback(ctx))
	assert.Equal(t, 0, processed(t, ctx, pool, "orders", "evt-1"))

	assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, c).Outcome, "claimable again after a rollback")
	assert.Equal(t, 1, processed(t, ctx, pool, "orders", "evt-1"))
}

func TestClaimDuplicate(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	c := dedup.Claim{Consumer: "orders", EventID: "evt-1", Fingerprint: []byte("same")}

	before := time.Now()
	require.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, c).Outcome)
	r := claimTx(t, ctx, pool, s, c)
	assert.Equal(t, dedup.Duplicate, r.Outcome)
	assert.Equal(t, []byte("same"), r.Previous.Fingerprint)
	assert.False(t, r.Previous.ProcessedAt.IsZero(), "Previous.ProcessedAt set")
	assert.WithinDuration(t, before, r.Previous.ProcessedAt, time.Minute)

	var stored time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT processed_at FROM processed_events WHERE event_id = 'evt-1'`).Scan(&stored))
	assert.True(t, stored.Equal(r.Previous.ProcessedAt), "ProcessedAt %v is the stored %v", r.Previous.ProcessedAt, stored)
	assert.Equal(t, 1, processed(t, ctx, pool, "orders", "evt-1"))
}

func TestClaimDuplicateInSameTransaction(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	c := dedup.Claim{Consumer: "orders", EventID: "evt-1", Fingerprint: []byte("a")}

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	r, err := s.Claim(ctx, tx, c)
	require.NoError(t, err)
	assert.Equal(t, dedup.Claimed, r.Outcome)
	r, err = s.Claim(ctx, tx, c)
	require.NoError(t, err)
	assert.Equal(t, dedup.Duplicate, r.Outcome)
	c.Fingerprint = []byte("b")
	r, err = s.Claim(ctx, tx, c)
	require.NoError(t, err)
	assert.Equal(t, dedup.Conflict, r.Outcome)
	assert.Equal(t, []byte("a"), r.Previous.Fingerprint)
}

func TestClaimConflict(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)

	first := dedup.Claim{Consumer: "orders", EventID: "evt-1", Fingerprint: []byte{0xde, 0xad}}
	require.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, first).Outcome)
	second := first
	second.Fingerprint = []byte{0xbe, 0xef}
	r := claimTx(t, ctx, pool, s, second)
	assert.Equal(t, dedup.Conflict, r.Outcome)
	assert.Equal(t, []byte{0xde, 0xad}, r.Previous.Fingerprint)
	assert.False(t, r.Previous.ProcessedAt.IsZero())

	// The conflicting claim changed nothing.
	var fp []byte
	require.NoError(t, pool.QueryRow(ctx, `SELECT fingerprint FROM processed_events WHERE event_id = 'evt-1'`).Scan(&fp))
	assert.Equal(t, []byte{0xde, 0xad}, fp)
}

func TestClaimNilFingerprintIsDuplicate(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	cases := []struct {
		name          string
		first, second []byte
		want          dedup.Outcome
		wantPrevious  []byte
	}{
		{"stored nil, new set", nil, []byte("x"), dedup.Duplicate, nil},
		{"stored set, new nil", []byte("x"), nil, dedup.Duplicate, []byte("x")},
		{"both nil", nil, nil, dedup.Duplicate, nil},
		{"both empty", []byte{}, []byte{}, dedup.Duplicate, []byte{}},
		{"empty vs set", []byte{}, []byte("x"), dedup.Conflict, []byte{}},
	}
	for i, tc := range cases {
		id := fmt.Sprintf("evt-%d", i)
		require.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: id, Fingerprint: tc.first}).Outcome, tc.name)
		r := claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: id, Fingerprint: tc.second})
		assert.Equal(t, tc.want, r.Outcome, tc.name)
		assert.Equal(t, tc.wantPrevious, r.Previous.Fingerprint, tc.name)
	}
}

type storedRow struct {
	Fingerprint []byte
	Source      string
	Partition   *int32
	Offset      *int64
}

func stored(t testing.TB, ctx context.Context, db dedup.DB, consumer, id string) storedRow {
	t.Helper()
	var r storedRow
	require.NoError(t, db.QueryRow(ctx, `SELECT fingerprint, source, partition, "offset" FROM processed_events
WHERE consumer = $1 AND event_id = $2`, consumer, id).Scan(&r.Fingerprint, &r.Source, &r.Partition, &r.Offset))
	return r
}

func ptr[T any](v T) *T { return &v }

func TestClaimStoresWhereEventCameFrom(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)

	claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "kafka", Fingerprint: []byte{9},
		Source: "orders", Partition: 3, Offset: 1 << 40})
	claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "zero", Source: "orders", Partition: 0, Offset: 0})
	claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "amqp", Source: "orders-queue", Partition: -1, Offset: -1})
	claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "mixed", Partition: -5, Offset: 7})

	assert.Equal(t, storedRow{[]byte{9}, "orders", ptr[int32](3), ptr[int64](1 << 40)}, stored(t, ctx, pool, "c", "kafka"))
	assert.Equal(t, storedRow{nil, "orders", ptr[int32](0), ptr[int64](0)}, stored(t, ctx, pool, "c", "zero"))
	assert.Equal(t, storedRow{nil, "orders-queue", nil, nil}, stored(t, ctx, pool, "c", "amqp"))
	assert.Equal(t, storedRow{nil, "", nil, ptr[int64](7)}, stored(t, ctx, pool, "c", "mixed"))
}

func TestClaimConsumersAreIndependent(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)

	a := dedup.Claim{Consumer: "billing", EventID: "evt-1", Fingerprint: []byte("a")}
	b := dedup.Claim{Consumer: "shipping", EventID: "evt-1", Fingerprint: []byte("b")}
	assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, a).Outcome)
	assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, b).Outcome, "another consumer's claim of the same id")
	assert.Equal(t, dedup.Duplicate, claimTx(t, ctx, pool, s, a).Outcome)
	assert.Equal(t, dedup.Duplicate, claimTx(t, ctx, pool, s, b).Outcome, "fingerprints compared per consumer")
}

// --- concurrency ------------------------------------------------------------

// waitBlocked waits until the backend pid is waiting on a lock held by
// another session.
func waitBlocked(t *testing.T, ctx context.Context, pool *pgxpool.Pool, pid uint32) {
	t.Helper()
	require.Eventually(t, func() bool {
		var blocked bool
		err := pool.QueryRow(ctx, `SELECT cardinality(pg_blocking_pids($1)) > 0`, int32(pid)).Scan(&blocked)
		return err == nil && blocked
	}, 30*time.Second, 5*time.Millisecond, "the second claim never waited on the first's lock")
}

func testClaimWaitsForOpenClaim(t *testing.T, commitFirst bool) {
	ctx, pool, s := setup(t)
	c := dedup.Claim{Consumer: "c", EventID: "contended", Fingerprint: []byte("fp")}

	first, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer first.Rollback(ctx) //nolint:errcheck
	r, err := s.Claim(ctx, first, c)
	require.NoError(t, err)
	require.Equal(t, dedup.Claimed, r.Outcome)

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	pid := conn.Conn().PgConn().PID()
	second, err := conn.Begin(ctx)
	require.NoError(t, err)
	defer second.Rollback(ctx) //nolint:errcheck

	type result struct {
		r   dedup.Result
		err error
	}
	done := make(chan result, 1)
	go func() {
		r, err := s.Claim(ctx, second, c)
		done <- result{r, err}
	}()

	waitBlocked(t, ctx, pool, pid)
	select {
	case got := <-done:
		t.Fatalf("second Claim returned %+v while the first claim's tx was open", got)
	default:
	}
	assert.Never(t, func() bool { return len(done) > 0 }, 100*time.Millisecond, 10*time.Millisecond,
		"second Claim returned while the first claim's tx was open")

	if commitFirst {
		require.NoError(t, first.Commit(ctx))
	} else {
		require.NoError(t, first.Rollback(ctx))
	}
	var got result
	select {
	case got = <-done:
	case <-ctx.Done():
		t.Fatal("second Claim did not return after the first tx ended")
	}
	require.NoError(t, got.err)
	if commitFirst {
		assert.Equal(t, dedup.Duplicate, got.r.Outcome)
		assert.Equal(t, []byte("fp"), got.r.Previous.Fingerprint)
		assert.False(t, got.r.Previous.ProcessedAt.IsZero())
	} else {
		assert.Equal(t, dedup.Claimed, got.r.Outcome)
	}
	require.NoError(t, second.Commit(ctx))
	assert.Equal(t, 1, processed(t, ctx, pool, "c", "contended"))
}

func TestClaimWaitsThenClaimsWhenFirstRollsBack(t *testing.T) {
	t.Parallel()
	testClaimWaitsForOpenClaim(t, false)
}

func TestClaimWaitsThenDuplicateWhenFirstCommits(t *testing.T) {
	t.Parallel()
	testClaimWaitsForOpenClaim(t, true)
}

func TestClaimConcurrentStress(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	_, err := pool.Exec(ctx, `CREATE TABLE effects (event_id text NOT NULL, worker int NOT NULL)`)
	require.NoError(t, err)

	const workers, ids = 8, 50
	var claimed, duplicates atomic.Int64
	errs := make([]error, workers)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			<-start
			errs[w] = func() error {
				for i := range ids {
					// Half the workers walk the ids backwards, so they meet
					// the others in the middle of open transactions.
					if w%2 == 1 {
						i = ids - 1 - i
					}
					id := fmt.Sprintf("evt-%02d", i)
					if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
						r, err := s.Claim(ctx, tx, dedup.Claim{Consumer: "c", EventID: id, Fingerprint: []byte(id)})
						if err != nil {
							return err
						}
						switch r.Outcome {
						case dedup.Claimed:
							claimed.Add(1)
							_, err = tx.Exec(ctx, `INSERT INTO effects VALUES ($1, $2)`, id, w)
							return err
						case dedup.Duplicate:
							duplicates.Add(1)
							return nil
						default:
							return fmt.Errorf("%s: unexpected %v", id, r.Outcome)
						}
					}); err != nil {
						return err
					}
				}
				return nil
			}()
		})
	}
	close(start)
	wg.Wait()
	for w, err := range errs {
		require.NoError(t, err, "worker %d", w)
	}

	assert.Equal(t, int64(ids), claimed.Load())
	assert.Equal(t, int64(ids*(workers-1)), duplicates.Load())
	assert.Equal(t, ids, rowCount(t, ctx, pool, `SELECT count(DISTINCT event_id) FROM effects`))
	assert.Equal(t, 0, rowCount(t, ctx, pool, `SELECT count(*) FROM (SELECT event_id FROM effects GROUP BY 1 HAVING count(*) <> 1) x`),
		"exactly one business row per id")
	assert.Equal(t, ids, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`))
}

// --- ClaimBatch -------------------------------------------------------------

func TestClaimBatchAllNew(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)

	claims := make([]dedup.Claim, 100)
	for i := range claims {
		claims[i] = dedup.Claim{Consumer: "c", EventID: fmt.Sprintf("evt-%03d", i),
			Fingerprint: []byte{byte(i)}, Source: "topic", Partition: 2, Offset: int64(1000 + i)}
	}
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	db := &countingDB{DB: tx}
	results, err := s.ClaimBatch(ctx, db, claims)
	require.NoError(t, err)
	require.Len(t, results, 100)
	for i, r := range results {
		assert.Equal(t, dedup.Result{Outcome: dedup.Claimed}, r, "claim %d", i)
	}
	assert.Equal(t, int64(1), db.n.Load(), "a batch of new ids is one statement")
	assert.Equal(t, 0, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`), "nothing visible before commit")
	require.NoError(t, tx.Commit(ctx))

	assert.Equal(t, 100, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`))
	assert.Equal(t, storedRow{[]byte{42}, "topic", ptr[int32](2), ptr[int64](1042)}, stored(t, ctx, pool, "c", "evt-042"))
}

func TestClaimBatchMixed(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)

	claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "old-same", Fingerprint: []byte("A")})
	claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "old-diff", Fingerprint: []byte("A")})
	claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "old-nil", Fingerprint: nil})
	claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "other", EventID: "new-1", Fingerprint: []byte("other")})

	batch := []dedup.Claim{
		{Consumer: "c", EventID: "new-1", Fingerprint: []byte("n1"), Source: "q", Partition: -1, Offset: -1},
		{Consumer: "c", EventID: "old-same", Fingerprint: []byte("A")},
		{Consumer: "c", EventID: "old-diff", Fingerprint: []byte("B")},
		{Consumer: "c", EventID: "rep", Fingerprint: []byte("R")},
		{Consumer: "c", EventID: "new-2", Fingerprint: nil, Source: "q", Partition: 1, Offset: 5},
		{Consumer: "c", EventID: "rep", Fingerprint: []byte("R")},
		{Consumer: "c", EventID: "old-nil", Fingerprint: []byte("Z")},
		{Consumer: "c", EventID: "rep2", Fingerprint: []byte("first")},
		{Consumer: "c", EventID: "rep2", Fingerprint: []byte("second")},
		{Consumer: "c", EventID: "rep2", Fingerprint: nil},
	}
	want := []dedup.Outcome{
		dedup.Claimed, dedup.Duplicate, dedup.Conflict, dedup.Claimed, dedup.Claimed,
		dedup.Duplicate, dedup.Duplicate, dedup.Claimed, dedup.Conflict, dedup.Duplicate,
	}
	wantPrev := [][]byte{nil, []byte("A"), []byte("A"), nil, nil, []byte("R"), nil, nil, []byte("first"), []byte("first")}

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	db := &countingDB{DB: tx}
	results, err := s.ClaimBatch(ctx, db, batch)
	require.NoError(t, err)
	require.Len(t, results, len(batch))
	for i, r := range results {
		assert.Equal(t, want[i], r.Outcome, "claim %d (%s)", i, batch[i].EventID)
		assert.Equal(t, wantPrev[i], r.Previous.Fingerprint, "claim %d (%s) previous fingerprint", i, batch[i].EventID)
		assert.Equal(t, r.Outcome == dedup.Claimed, r.Previous.ProcessedAt.IsZero(),
			"claim %d (%s): ProcessedAt set exactly for a duplicate or conflict", i, batch[i].EventID)
	}
	assert.Equal(t, int64(1), db.n.Load(), "one statement claims the batch and reads the previous rows")
	require.NoError(t, tx.Commit(ctx))

	assert.Equal(t, storedRow{[]byte("n1"), "q", nil, nil}, stored(t, ctx, pool, "c", "new-1"))
	assert.Equal(t, storedRow{nil, "q", ptr[int32](1), ptr[int64](5)}, stored(t, ctx, pool, "c", "new-2"))
	assert.Equal(t, []byte("first"), stored(t, ctx, pool, "c", "rep2").Fingerprint, "the first appearance is stored")
	assert.Equal(t, []byte("A"), stored(t, ctx, pool, "c", "old-diff").Fingerprint, "a conflict changes nothing")
	assert.Equal(t, []byte("other"), stored(t, ctx, pool, "other", "new-1").Fingerprint)
	assert.Equal(t, 7, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events WHERE consumer = 'c'`))
}

func TestClaimBatchRolledBack(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	batch := []dedup.Claim{{Consumer: "c", EventID: "a"}, {Consumer: "c", EventID: "b"}}

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	_, err = s.ClaimBatch(ctx, tx, batch)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))

	tx, err = pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	results, err := s.ClaimBatch(ctx, tx, batch)
	require.NoError(t, err)
	assert.Equal(t, []dedup.Result{{Outcome: dedup.Claimed}, {Outcome: dedup.Claimed}}, results)
}

func TestClaimBatchMixedConsumers(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	db := &countingDB{DB: tx}
	results, err := s.ClaimBatch(ctx, db, []dedup.Claim{
		{Consumer: "a", EventID: "1"},
		{Consumer: "a", EventID: "2"},
		{Consumer: "b", EventID: "3"},
	})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "mixed consumers")
	assert.Nil(t, results)
	assert.Equal(t, int64(0), db.n.Load(), "nothing sent")
	require.NoError(t, tx.Commit(ctx))
	assert.Equal(t, 0, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`))
}

func TestClaimBatchEmpty(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	db := &countingDB{DB: pool}
	for _, claims := range [][]dedup.Claim{nil, {}} {
		results, err := s.ClaimBatch(ctx, db, claims)
		assert.NoError(t, err)
		assert.Nil(t, results)
	}
	assert.Equal(t, int64(0), db.n.Load())
}

// seedAttempt writes a crash-guard record as the consumer does, into the
// attempts table of the store's default names on the pool's search_path
// (or table, when given).
func seedAttempt(t testing.TB, ctx context.Context, db dedup.DB, table, consumer, id string) {
	t.Helper()
	if table == "" {
		table = "processed_events_attempts"
	}
	_, err := db.Exec(ctx, `INSERT INTO `+table+` (consumer, event_id, attempts, crashes) VALUES ($1, $2, 1, 1)
ON CONFLICT (consumer, event_id) DO UPDATE SET attempts = `+table+`.attempts + 1`, consumer, id)
	require.NoError(t, err)
}

// --- retention --------------------------------------------------------------

// seedRetention claims old+young ids and ages the old ones by two days; it
// does the same for attempt rows. It returns the cutoff (one day ago).
func seedRetention(t testing.TB, ctx context.Context, pool *pgxpool.Pool, s *dedup.Store, old, young, oldAttempts, youngAttempts int) time.Time {
	t.Helper()
	claims := make([]dedup.Claim, 0, old+young)
	for i := range old + young {
		claims = append(claims, dedup.Claim{Consumer: "c0", EventID: fmt.Sprintf("evt-%03d", i)})
	}
	func() {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
		_, err = s.ClaimBatch(ctx, tx, claims)
		require.NoError(t, err)
		require.NoError(t, tx.Commit(ctx))
	}()
	_, err := pool.Exec(ctx, `UPDATE processed_events SET processed_at = now() - interval '2 days' WHERE event_id < $1`,
		fmt.Sprintf("evt-%03d", old))
	require.NoError(t, err)

	for i := range oldAttempts + youngAttempts {
		seedAttempt(t, ctx, pool, "", "c0", fmt.Sprintf("try-%03d", i))
	}
	_, err = pool.Exec(ctx, `UPDATE processed_events_attempts SET last_seen = now() - interval '2 days' WHERE event_id < $1`,
		fmt.Sprintf("try-%03d", oldAttempts))
	require.NoError(t, err)

	var cutoff time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT now() - interval '1 day'`).Scan(&cutoff))
	return cutoff
}

func TestDeleteOlderThan(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	cutoff := seedRetention(t, ctx, pool, s, 30, 5, 10, 3)

	db := &countingDB{DB: pool}
	n, err := s.DeleteOlderThan(ctx, db, "c0", cutoff, 7)
	require.NoError(t, err)
	assert.Equal(t, int64(30), n)
	// 30 rows by 7: 7,7,7,7,2; 10 attempt rows by 7: 7,3.
	assert.Equal(t, int64(5+2), db.n.Load(), "statements sent")

	assert.Equal(t, 5, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`))
	assert.Equal(t, 0, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events WHERE processed_at < $1`, cutoff))
	assert.Equal(t, 3, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events_attempts`))
	assert.Equal(t, 0, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events_attempts WHERE last_seen < $1`, cutoff))

	// A deleted id can be claimed again; a kept one is still a duplicate.
	assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c0", EventID: "evt-000"}).Outcome)
	assert.Equal(t, dedup.Duplicate, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c0", EventID: "evt-030"}).Outcome)

	n, err = s.DeleteOlderThan(ctx, pool, "c0", cutoff, 7)
	require.NoError(t, err)
	assert.Equal(t, int64(0), n, "nothing left to delete")
}

func TestDeleteOlderThanExactMultipleOfBatch(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	cutoff := seedRetention(t, ctx, pool, s, 14, 2, 0, 0)

	n, err := s.DeleteOlderThan(ctx, pool, "c0", cutoff, 7)
	require.NoError(t, err)
	assert.Equal(t, int64(14), n)
	assert.Equal(t, 2, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`))
}

func TestDeleteOlderThanDefaultBatch(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	cutoff := seedRetention(t, ctx, pool, s, 20, 3, 2, 1)

	for _, batch := range []int{0, -1} {
		db := &countingDB{DB: pool}
		n, err := s.DeleteOlderThan(ctx, db, "c0", cutoff, batch)
		require.NoError(t, err)
		if batch == 0 {
			assert.Equal(t, int64(20), n)
		} else {
			assert.Equal(t, int64(0), n)
		}
		assert.Equal(t, int64(2), db.n.Load(), "batch size %d means 1000: one statement per table", batch)
	}
	assert.Equal(t, 3, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`))
	assert.Equal(t, 1, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events_attempts`))
}

func TestDeleteOlderThanCancelled(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	cutoff := seedRetention(t, ctx, pool, s, 30, 5, 10, 0)

	t.Run("before", func(t *testing.T) {
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		n, err := s.DeleteOlderThan(cctx, pool, "c0", cutoff, 7)
		require.ErrorIs(t, err, context.Canceled)
		assert.Equal(t, int64(0), n)
		assert.Equal(t, 35, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`))
	})

	t.Run("between batches", func(t *testing.T) {
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		db := &countingDB{DB: pool, after: func(int64) { cancel() }}
		n, err := s.DeleteOlderThan(cctx, db, "c0", cutoff, 7)
		require.ErrorIs(t, err, context.Canceled)
		assert.Equal(t, int64(7), n, "the first batch was deleted and counted")
		assert.Equal(t, int64(1), db.n.Load(), "no statement after the cancel")
		assert.Equal(t, 28, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`))
		assert.Equal(t, 10, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events_attempts`),
			"attempts untouched once cancelled")
	})

	t.Run("deadline", func(t *testing.T) {
		cctx, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
		defer cancel()
		_, err := s.DeleteOlderThan(cctx, pool, "c0", cutoff, 7)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		assert.False(t, errors.Is(err, context.Canceled))
	})
}

// Two services share the table under their consumer names, with different
// retention windows: each one's retention removes only its own rows and
// attempt counts, so one service's short window never ends the other's
// deduplication.
func TestRetentionIsPerConsumer(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	for _, consumer := range []string{"billing", "shipping"} {
		for i := range 5 {
			claimTx(t, ctx, pool, s, dedup.Claim{Consumer: consumer, EventID: fmt.Sprintf("evt-%d", i)})
		}
		seedAttempt(t, ctx, pool, "", consumer, "in-flight")
	}
	for _, sql := range []string{
		`UPDATE processed_events SET processed_at = now() - interval '2 days'`,
		`UPDATE processed_events_attempts SET last_seen = now() - interval '2 days'`,
	} {
		_, err := pool.Exec(ctx, sql)
		require.NoError(t, err)
	}
	count := func(table, consumer string) int {
		return rowCount(t, ctx, pool, `SELECT count(*) FROM `+table+` WHERE consumer = $1`, consumer)
	}

	// billing keeps one hour, shipping a week.
	n, err := s.DeleteOlderThan(ctx, pool, "billing", time.Now().Add(-time.Hour), 2)
	require.NoError(t, err)
	assert.Equal(t, int64(5), n)
	n, err = s.DeleteOlderThan(ctx, pool, "shipping", time.Now().Add(-7*24*time.Hour), 2)
	require.NoError(t, err)
	assert.Equal(t, int64(0), n)

	assert.Equal(t, 0, count("processed_events", "billing"))
	assert.Equal(t, 0, count("processed_events_attempts", "billing"))
	assert.Equal(t, 5, count("processed_events", "shipping"), "billing's retention removed shipping's rows")
	assert.Equal(t, 1, count("processed_events_attempts", "shipping"), "billing's retention removed shipping's attempt counts")
	assert.Equal(t, dedup.Duplicate, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "shipping", EventID: "evt-0"}).Outcome,
		"shipping still deduplicates its redeliveries")
	assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "billing", EventID: "evt-0"}).Outcome)

	_, err = s.DeleteOlderThan(ctx, pool, "", time.Now(), 0)
	require.Error(t, err, "an empty consumer name is refused, not taken for every consumer")
	assert.Equal(t, 6, count("processed_events", "shipping")+count("processed_events", "billing"))
}

func TestOutcomeString(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "claimed", dedup.Claimed.String())
	assert.Equal(t, "duplicate", dedup.Duplicate.String())
	assert.Equal(t, "conflict", dedup.Conflict.String())
	assert.Equal(t, "Outcome(7)", dedup.Outcome(7).String())
}

// execModes are every query exec mode pgx has, the simple protocol and
// the modes that PgBouncer users choose among them.
var execModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement,
	pgx.QueryExecModeCacheDescribe,
	pgx.QueryExecModeDescribeExec,
	pgx.QueryExecModeExec,
	pgx.QueryExecModeSimpleProtocol,
}

// setupExecMode is setup with a pool whose default query exec mode is mode.
func setupExecMode(t *testing.T, mode pgx.QueryExecMode) (context.Context, *pgxpool.Pool, *dedup.Store) {
	t.Helper()
	ctx := testCtx(t)
	_, schema := pgtest.Schema(t)
	pool := pgtest.NewPoolWith(t, schema, func(cfg *pgxpool.Config) { cfg.ConnConfig.DefaultQueryExecMode = mode })
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	return ctx, pool, s
}

// The store works whatever query exec mode the pool uses, including the
// simple protocol and the exec modes that PgBouncer users choose.
func TestQueryExecModes(t *testing.T) {
	t.Parallel()
	for _, mode := range execModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx, pool, s := setupExecMode(t, mode)

			c := dedup.Claim{Consumer: "c", EventID: "one", Fingerprint: []byte{0, 1, 0xff}, Source: "s", Partition: 2, Offset: 3}
			assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, c).Outcome)
			r := claimTx(t, ctx, pool, s, c)
			assert.Equal(t, dedup.Duplicate, r.Outcome)
			assert.Equal(t, []byte{0, 1, 0xff}, r.Previous.Fingerprint)
			c.Partition, c.Offset = -1, -1
			c.EventID = "nulls"
			claimTx(t, ctx, pool, s, c)
			assert.Equal(t, storedRow{[]byte{0, 1, 0xff}, "s", nil, nil}, stored(t, ctx, pool, "c", "nulls"))

			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
			results, err := s.ClaimBatch(ctx, tx, []dedup.Claim{
				{Consumer: "c", EventID: "one", Fingerprint: []byte{9}},
				{Consumer: "c", EventID: "b1", Fingerprint: []byte{1}, Partition: -1, Offset: 4},
				{Consumer: "c", EventID: "b2", Fingerprint: nil, Source: "x", Partition: 5, Offset: -1},
				{Consumer: "c", EventID: "b1", Fingerprint: []byte{1}},
			})
			require.NoError(t, err)
			outcomes := make([]dedup.Outcome, len(results))
			for i, r := range results {
				outcomes[i] = r.Outcome
			}
			assert.Equal(t, []dedup.Outcome{dedup.Conflict, dedup.Claimed, dedup.Claimed, dedup.Duplicate}, outcomes)
			require.NoError(t, tx.Commit(ctx))
			assert.Equal(t, storedRow{[]byte{1}, "", nil, ptr[int64](4)}, stored(t, ctx, pool, "c", "b1"))
			assert.Equal(t, storedRow{nil, "x", ptr[int32](5), nil}, stored(t, ctx, pool, "c", "b2"))

			seedAttempt(t, ctx, pool, "", "c", "try")

			_, err = pool.Exec(ctx, `UPDATE processed_events SET processed_at = now() - interval '2 days' WHERE event_id <> 'one'`)
			require.NoError(t, err)
			deleted, err := s.DeleteOlderThan(ctx, pool, "c", time.Now().Add(-24*time.Hour), 2)
			require.NoError(t, err)
			assert.Equal(t, int64(3), deleted)
		})
	}
}

// The lookup of the previous row costs a second statement only when the id
// is not new.
func TestClaimStatementCount(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	c := dedup.Claim{Consumer: "c", EventID: "e"}
	for _, want := range []struct {
		outcome    dedup.Outcome
		statements int64
	}{{dedup.Claimed, 1}, {dedup.Duplicate, 2}} {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		db := &countingDB{DB: tx}
		r, err := s.Claim(ctx, db, c)
		require.NoError(t, err)
		assert.Equal(t, want.outcome, r.Outcome)
		assert.Equal(t, want.statements, db.n.Load(), "statements for %v", want.outcome)
		require.NoError(t, tx.Commit(ctx))
	}
}

// A 48-byte table name (the longest allowed) migrates, twice, and works: the
// names derived from it fit PostgreSQL's 63-byte limit or truncate harmlessly.
func TestLongestTableName(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, schema := pgtest.Schema(t)
	for _, table := range []string{strings.Repeat("a", 47) + "1", strings.Repeat("a", 47) + "2"} {
		s, err := dedup.New(dedup.Config{Table: table})
		require.NoError(t, err)
		require.NoError(t, s.Migrate(ctx, pool))
		require.NoError(t, s.Migrate(ctx, pool))
		assertSchema(t, ctx, pool, schema, table)
		assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "1"}).Outcome)
		seedAttempt(t, ctx, pool, s.AttemptsTable(), "c", "2")
	}
}

// Retention can delete the row a claim conflicted with between Claim's
// insert and its lookup of the previous row. Claim must still answer with an
// outcome (the row is gone, so the id may be claimed again, as after any
// retention), not fail with "no rows in result set".
func TestClaimRaceWithRetention(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	c := dedup.Claim{Consumer: "c", EventID: "aging", Fingerprint: []byte("fp")}
	claimTx(t, ctx, pool, s, c)
	_, err := pool.Exec(ctx, `UPDATE processed_events SET processed_at = now() - interval '2 days'`)
	require.NoError(t, err)

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	var deleted int64
	var deleteErr error
	db := &countingDB{DB: tx, after: func(n int64) {
		if n == 1 { // after the insert found the old row, before the lookup
			deleted, deleteErr = s.DeleteOlderThan(ctx, pool, "c", time.Now().Add(-24*time.Hour), 0)
		}
	}}
	r, err := s.Claim(ctx, db, c)
	require.NoError(t, deleteErr)
	require.Equal(t, int64(1), deleted, "retention removed the row in between")
	require.NoError(t, err, "Claim after its previous row was removed by retention")
	assert.Contains(t, []dedup.Outcome{dedup.Claimed, dedup.Duplicate}, r.Outcome)
	require.NoError(t, tx.Commit(ctx))
	if r.Outcome == dedup.Claimed {
		assert.Equal(t, 1, processed(t, ctx, pool, "c", "aging"))
	}
}

// Each retention statement starts where the previous one stopped; rows
// sharing the timestamp at which a batch stopped are not skipped.
func TestDeleteOlderThanEqualTimestampsAcrossBatches(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	_, err := pool.Exec(ctx, `INSERT INTO processed_events (consumer, event_id, processed_at)
SELECT 'c0', 'old-' || i, now() - interval '2 days' - (i % 3) * interval '1 hour' FROM generate_series(1, 25) i`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO processed_events (consumer, event_id) SELECT 'c0', 'new-' || i FROM generate_series(1, 4) i`)
	require.NoError(t, err)

	n, err := s.DeleteOlderThan(ctx, pool, "c0", time.Now().Add(-24*time.Hour), 4)
	require.NoError(t, err)
	assert.Equal(t, int64(25), n, "three timestamps shared by 8-9 rows each, deleted 4 at a time")
	assert.Equal(t, 4, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`))
}

// A table partitioned by a hash of the event id (to spread a large table;
// its key (consumer, event_id) holds the partition key, so Migrate and
// Check accept it) has rows of the same ctid in each partition: retention
// deleted, beside each expired row, every row of that ctid in the other
// partitions, of any consumer, however young, and those ids were then
// handled again. Only the expired rows of the consumer go now, of both
// tables.
func TestRetentionOnHashPartitionedTables(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(ctx, `CREATE TABLE processed_events (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL,
    fingerprint  bytea,
    processed_at timestamptz NOT NULL DEFAULT now(),
    source       text        NOT NULL DEFAULT '',
    partition    integer,
    "offset"     bigint,
    PRIMARY KEY (consumer, event_id)
) PARTITION BY HASH (event_id);
CREATE TABLE processed_events_p0 PARTITION OF processed_events FOR VALUES WITH (MODULUS 2, REMAINDER 0);
CREATE TABLE processed_events_p1 PARTITION OF processed_events FOR VALUES WITH (MODULUS 2, REMAINDER 1);
CREATE TABLE processed_events_attempts (
    consumer  text        NOT NULL,
    event_id  text        NOT NULL,
    attempts  integer     NOT NULL,
    last_seen timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
) PARTITION BY HASH (event_id);
CREATE TABLE processed_events_attempts_p0 PARTITION OF processed_events_attempts FOR VALUES WITH (MODULUS 2, REMAINDER 0);
CREATE TABLE processed_events_attempts_p1 PARTITION OF processed_events_attempts FOR VALUES WITH (MODULUS 2, REMAINDER 1)`)
	require.NoError(t, err)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	_, err = pool.Exec(ctx, `INSERT INTO processed_events (consumer, event_id, processed_at)
SELECT 'old', 'o-' || i, now() - interval '30 days' FROM generate_series(1, 100) i;
INSERT INTO processed_events (consumer, event_id) SELECT 'young', 'y-' || i FROM generate_series(1, 100) i;
INSERT INTO processed_events_attempts (consumer, event_id, attempts, last_seen)
SELECT 'old', 'o-' || i, 1, now() - interval '30 days' FROM generate_series(1, 100) i;
INSERT INTO processed_events_attempts (consumer, event_id, attempts) SELECT 'young', 'y-' || i, 1 FROM generate_series(1, 100) i`)
	require.NoError(t, err)

	n, err := s.DeleteOlderThan(ctx, pool, "old", time.Now().Add(-time.Hour), 10)
	require.NoError(t, err)
	assert.Equal(t, int64(100), n)
	for _, table := range []string{"processed_events", "processed_events_attempts"} {
		assert.Equal(t, 0, rowCount(t, ctx, pool, `SELECT count(*) FROM `+table+` WHERE consumer = 'old'`), table)
		assert.Equal(t, 100, rowCount(t, ctx, pool, `SELECT count(*) FROM `+table+` WHERE consumer = 'young'`),
			"%s: another consumer's young rows are kept", table)
	}
	assert.Equal(t, dedup.Duplicate, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "young", EventID: "y-1"}).Outcome)
}
