package migrate_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/migrate"
	"github.com/onceco/once/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// widgets is a component of two versions whose table name is a template
// parameter.
var widgets = fstest.MapFS{
	"001_widgets.up.sql":    {Data: []byte(`CREATE TABLE {{.Table}} (id int PRIMARY KEY);`)},
	"001_widgets.down.sql":  {Data: []byte(`DROP TABLE {{.Table}};`)},
	"002_add_name.up.sql":   {Data: []byte(`ALTER TABLE {{.Table}} ADD COLUMN name text;`)},
	"002_add_name.down.sql": {Data: []byte(`ALTER TABLE {{.Table}} DROP COLUMN name;`)},
	"notes/README":          {Data: []byte(`directories are skipped`)},
}

func series(t *testing.T, table string) *migrate.Series {
	t.Helper()
	migs, err := migrate.Load(widgets, map[string]string{"Table": table})
	require.NoError(t, err)
	return &migrate.Series{Component: "widgets:" + table, Migrations: migs}
}

func TestLoad(t *testing.T) {
	t.Parallel()
	migs, err := migrate.Load(widgets, map[string]string{"Table": "w"})
	require.NoError(t, err)
	require.Len(t, migs, 2)
	assert.Equal(t, migrate.Migration{Version: 1, Name: "widgets",
		Up: `CREATE TABLE w (id int PRIMARY KEY);`, Down: `DROP TABLE w;`}, migs[0])
	assert.Equal(t, 2, migs[1].Version)
	assert.Equal(t, "add_name", migs[1].Name)
}

func TestLoadRejectsBadSeries(t *testing.T) {
	t.Parallel()
	file := func(s string) *fstest.MapFile { return &fstest.MapFile{Data: []byte(s)} }
	for name, tc := range map[string]struct {
		fs   fstest.MapFS
		want string
	}{
		"gap":          {fstest.MapFS{"001_a.up.sql": file("x"), "001_a.down.sql": file("x"), "003_c.up.sql": file("x"), "003_c.down.sql": file("x")}, "without a gap"},
		"no down":      {fstest.MapFS{"001_a.up.sql": file("x")}, "both an up and a down"},
		"bad name":     {fstest.MapFS{"1-a.sql": file("x")}, "not named"},
		"two names":    {fstest.MapFS{"001_a.up.sql": file("x"), "001_b.down.sql": file("x")}, "named both"},
		"missing key":  {fstest.MapFS{"001_a.up.sql": file("{{.Nope}}"), "001_a.down.sql": file("x")}, "Nope"},
		"not at one":   {fstest.MapFS{"002_a.up.sql": file("x"), "002_a.down.sql": file("x")}, "without a gap"},
		"bad template": {fstest.MapFS{"001_a.up.sql": file("{{"), "001_a.down.sql": file("x")}, "001_a.up.sql"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := migrate.Load(tc.fs, map[string]string{})
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}

func columns(t *testing.T, ctx context.Context, db migrate.Querier, table string) []string {
	t.Helper()
	var cols []string
	require.NoError(t, db.QueryRow(ctx, `SELECT coalesce(array_agg(attname::text ORDER BY attnum), '{}') FROM pg_attribute
WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped`, table).Scan(&cols))
	return cols
}

func TestUpDownAndVersion(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	s := series(t, "w")
	version := func() int {
		v, err := s.Version(ctx, pool)
		require.NoError(t, err)
		return v
	}
	assert.Equal(t, 0, version(), "no version table yet")

	require.NoError(t, s.MigrateTo(ctx, pool, 1))
	assert.Equal(t, 1, version())
	assert.Equal(t, []string{"id"}, columns(t, ctx, pool, "w"))
	require.NoError(t, s.Migrate(ctx, pool))
	require.NoError(t, s.Migrate(ctx, pool), "idempotent")
	assert.Equal(t, 2, version())
	assert.Equal(t, []string{"id", "name"}, columns(t, ctx, pool, "w"))

	// Another component in the same version table is independent.
	other := series(t, "v")
	require.NoError(t, other.MigrateTo(ctx, pool, 1))
	assert.Equal(t, 2, version())

	require.NoError(t, s.MigrateTo(ctx, pool, 0))
	assert.Equal(t, 0, version())
	assert.Empty(t, columns(t, ctx, pool, "w"))
	v, err := other.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, 1, v)
}

// A failing migration leaves the database as it was: the earlier steps of
// the same call are rolled back with it, and no version is recorded.
func TestFailedMigrationChangesNothing(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	bad := fstest.MapFS{
		"001_ok.up.sql":    {Data: []byte(`CREATE TABLE ok (id int);`)},
		"001_ok.down.sql":  {Data: []byte(`DROP TABLE ok;`)},
		"002_bad.up.sql":   {Data: []byte(`ALTER TABLE ok ADD COLUMN id int;`)},
		"002_bad.down.sql": {Data: []byte(`SELECT 1;`)},
	}
	migs, err := migrate.Load(bad, nil)
	require.NoError(t, err)
	s := &migrate.Series{Component: "bad", Migrations: migs}
	err = s.Migrate(ctx, pool)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "version 2 (bad) up")
	assert.Empty(t, columns(t, ctx, pool, "ok"), "version 1 rolled back with 2")
	v, err := s.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, 0, v)
}

func TestNewerIsRefused(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	s := series(t, "w")
	require.NoError(t, s.Migrate(ctx, pool))
	older := &migrate.Series{Component: s.Component, Migrations: s.Migrations[:1]}
	err := older.Migrate(ctx, pool)
	require.ErrorIs(t, err, migrate.ErrNewer)
	assert.Contains(t, err.Error(), "version 2")
	assert.Equal(t, []string{"id", "name"}, columns(t, ctx, pool, "w"), "unchanged")
}

func TestAdoptAndVerify(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(ctx, `CREATE TABLE w (id int PRIMARY KEY)`) // version 1, made before versions were kept
	require.NoError(t, err)
	s := series(t, "w")
	s.Adopt = func(ctx context.Context, tx pgx.Tx) (int, error) {
		var exists bool
		err := tx.QueryRow(ctx, `SELECT to_regclass('w') IS NOT NULL`).Scan(&exists)
		if exists {
			return 1, err
		}
		return 0, err
	}
	verified := 0
	s.Verify = func(ctx context.Context, tx pgx.Tx) error { verified++; return nil }
	require.NoError(t, s.Migrate(ctx, pool), "version 1 is not run again over the adopted table")
	assert.Equal(t, []string{"id", "name"}, columns(t, ctx, pool, "w"))
	assert.Equal(t, 1, verified)

	s.Verify = func(ctx context.Context, tx pgx.Tx) error { return errors.New("not our table") }
	require.ErrorContains(t, s.Migrate(ctx, pool), "not our table")
}

func TestConcurrentMigrations(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		s := series(t, []string{"w", "v"}[i%2])
		wg.Go(func() { errs[i] = s.Migrate(ctx, pool) })
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	var rows int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM once_schema_versions`).Scan(&rows))
	assert.Equal(t, 4, rows, "each version of each component recorded once")
}

// A migration that waited for the migration lock longer than its session's
// statement_timeout (another process migrating: building an index on a
// big table takes seconds) failed with 57014, and the start of the
// consumer or relay that ran it ended with the error. It waits for the
// lock without a statement that waits: each try is a short transaction of
// its own, so neither statement_timeout nor
// idle_in_transaction_session_timeout ends the wait.
func TestMigrationWaitsForTheLockPastTheSessionsTimeouts(t *testing.T) {
	ctx := testCtx(t)
	admin, schema := pgtest.Schema(t)
	holder, err := admin.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, 0x6f6e6365)
	require.NoError(t, err)
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["statement_timeout"] = "100ms"
		c.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = "100ms"
	})
	s := series(t, "w")
	done := make(chan error, 1)
	go func() { done <- s.Migrate(ctx, pool) }()
	select {
	case err := <-done:
		t.Fatalf("Migrate returned while another transaction held the migration lock: %v", err)
	case <-time.After(time.Second): // ten times either timeout
	}
	require.NoError(t, holder.Rollback(ctx))
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Migrate still waits 30 s after the lock was released")
	}
	v, err := s.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, 2, v)
}

// A migration step that waits for its table's lock (an ALTER TABLE behind
// a transaction that wrote to the table and runs on: a batch of slow
// handlers) held every writer of the table behind it in PostgreSQL's lock
// queue for as long as that transaction ran: one process's upgrade stopped
// every consumer of the table. A step waits at most a second for a lock;
// then the migration is rolled back, which lets the writers through, and
// tried again after a backoff, until the table is free.
func TestMigrationWaitingForItsTableDoesNotHoldWritersBack(t *testing.T) {
	ctx := testCtx(t)
	pool, s, long, done := migrateBehindALongTransaction(t, ctx)
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks
			WHERE relation = 'w'::regclass AND mode = 'AccessExclusiveLock' AND NOT granted`).Scan(&n))
		return n > 0
	}, 10*time.Second, time.Millisecond, "the migration never waited for the table")
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err := pool.Exec(wctx, `INSERT INTO w VALUES (2)`)
	require.NoError(t, err, "a writer of the table waited behind the migration")

	require.NoError(t, long.Commit(ctx))
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Migrate still waits 30 s after the table was free")
	}
	v, err := s.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, 2, v)
}

// Each try of a migration that waited for its table's lock waits twice as
// long as the one before, so that beside transactions that always hold
// the table it still gets its turn: a fixed second could be shorter than
// each of them. Seen from the server, one of the waits behind a
// transaction that holds the table for 4 s lasts longer than the first
// try's second.
func TestMigrationWaitsLongerAtEachTry(t *testing.T) {
	ctx := testCtx(t)
	pool, _, long, done := migrateBehindALongTransaction(t, ctx)

	released := time.After(4 * time.Second) // the long transaction's work
	var longest time.Duration
	for waiting := true; waiting; {
		var waited *time.Duration
		require.NoError(t, pool.QueryRow(ctx, `SELECT max(now() - a.query_start) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
			WHERE l.relation = 'w'::regclass AND l.mode = 'AccessExclusiveLock' AND NOT l.granted`).Scan(&waited))
		if waited != nil {
			longest = max(longest, *waited)
		}
		select {
		case <-released:
			waiting = false
		case <-time.After(10 * time.Millisecond):
		}
	}
	require.NoError(t, long.Commit(ctx))
	require.NoError(t, <-done)
	assert.Greater(t, longest, 1500*time.Millisecond, "no try waited longer than the first")
}

// migrateBehindALongTransaction creates w at version 1, begins a
// transaction that writes to it and stays open (long; rolled back when the
// test ends), and starts migrating w to version 2 (an ALTER TABLE, which
// waits for long), whose result done receives.
func migrateBehindALongTransaction(t *testing.T, ctx context.Context) (*pgxpool.Pool, *migrate.Series, pgx.Tx, <-chan error) {
	t.Helper()
	pool, _ := pgtest.Schema(t)
	s := series(t, "w")
	require.NoError(t, s.MigrateTo(ctx, pool, 1))
	long, err := pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = long.Rollback(ctx) })
	_, err = long.Exec(ctx, `INSERT INTO w VALUES (1)`)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- s.Migrate(ctx, pool) }()
	return pool, s, long, done
}

// stallEvery holds the client up for stall after the first statement of
// every transaction, and counts the transactions it held up.
type stallEvery struct {
	stall time.Duration
	n     atomic.Int32
}

func (s *stallEvery) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (s *stallEvery) TraceQueryEnd(_ context.Context, conn *pgx.Conn, d pgx.TraceQueryEndData) {
	if conn.PgConn().TxStatus() == 'T' && d.CommandTag.String() == "SELECT 1" {
		s.n.Add(1)
		time.Sleep(s.stall)
	}
}

// The server ending a migration's session past
// idle_in_transaction_session_timeout (the process held up between two of
// its statements, once) failed the migration, and the start of the
// consumer or relay that ran it. The migration is tried again; a setting
// too short for any try is returned after maxIdledOut more tries, not
// retried for ever.
func TestMigrationWhoseSessionTheServerEndedForIdlingIsTriedAgain(t *testing.T) {
	t.Run("held up once", func(t *testing.T) {
		ctx := testCtx(t)
		_, schema := pgtest.Schema(t)
		tracer := &pgtest.StallOnce{Stall: 300 * time.Millisecond}
		pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
			c.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = "50ms"
			c.ConnConfig.Tracer = tracer
		})
		s := series(t, "w")
		require.NoError(t, s.Migrate(ctx, pool))
		require.True(t, tracer.Stalled(), "the migration was not held up")
		v, err := s.Version(ctx, pool)
		require.NoError(t, err)
		assert.Equal(t, 2, v)
	})
	t.Run("held up every time", func(t *testing.T) {
		ctx := testCtx(t)
		_, schema := pgtest.Schema(t)
		tracer := &stallEvery{stall: 300 * time.Millisecond}
		pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
			c.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = "50ms"
			c.ConnConfig.Tracer = tracer
		})
		err := series(t, "w").Migrate(ctx, pool)
		var pe *pgconn.PgError
		require.ErrorAs(t, err, &pe)
		assert.Equal(t, "25P03", pe.Code)
		assert.EqualValues(t, 4, tracer.n.Load(), "tries: the first and three more")
	})
}
