package oncetest_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/oncetest"
)

// cleanupRecorder is a testing.TB whose cleanups run when the caller says
// and whose errors are recorded, not reported.
type cleanupRecorder struct {
	testing.TB
	mu       sync.Mutex
	cleanups []func()
	errors   []string
}

func (r *cleanupRecorder) Helper()          {}
func (r *cleanupRecorder) Cleanup(f func()) { r.cleanups = append(r.cleanups, f) }
func (r *cleanupRecorder) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}

// end runs the cleanups, last registered first, as a test's end does.
func (r *cleanupRecorder) end() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
}

// A test that ends with a transaction still open (a t.Fatal between Begin
// and Rollback) is told so, and its schema still goes: the server is
// shared by every test (DATABASE_URL), and a schema left behind stays.
func TestPostgresDropsTheSchemaOfATestThatLeftATransactionOpen(t *testing.T) {
	ctx := context.Background()
	rec := &cleanupRecorder{TB: t}
	pool := oncetest.Postgres(rec)
	var schema string
	require.NoError(t, pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema))
	_, err := pool.Exec(ctx, `CREATE TABLE payments (order_id text)`)
	require.NoError(t, err)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO payments VALUES ('o1')`)
	require.NoError(t, err)

	rec.end() // the test ends; tx is neither committed nor rolled back

	require.Len(t, rec.errors, 1, "%q", rec.errors)
	assert.Contains(t, rec.errors[0], "never released", "the unreleased connection is reported")
	admin, err := pgxpool.New(ctx, oncetest.URL(t))
	require.NoError(t, err)
	defer admin.Close()
	var left bool
	require.NoError(t, admin.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&left))
	assert.False(t, left, "schema %s is left on the server", schema)
}

// A session outside the pool (a connection the test opened with the pool's
// config, left in a transaction) holding a lock on a table of the schema
// made DROP SCHEMA wait out its bound: the schema was left on the server
// and nothing said so. The session is ended, and the schema still goes.
func TestPostgresDropsTheSchemaLockedByASessionOutsideThePool(t *testing.T) {
	ctx := context.Background()
	rec := &cleanupRecorder{TB: t}
	pool := oncetest.Postgres(rec)
	var schema string
	require.NoError(t, pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema))
	_, err := pool.Exec(ctx, `CREATE TABLE payments (order_id text)`)
	require.NoError(t, err)
	conn, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig)
	require.NoError(t, err)
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, `BEGIN; SELECT * FROM payments`)
	require.NoError(t, err)
	other, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig)
	require.NoError(t, err)
	defer other.Close(ctx)
	_, err = other.Exec(ctx, `BEGIN; CREATE TABLE refunds (order_id text)`) // not in pg_class for others yet
	require.NoError(t, err)

	rec.end() // the test ends; conn's transaction still holds its lock

	admin, err := pgxpool.New(ctx, oncetest.URL(t))
	require.NoError(t, err)
	defer admin.Close()
	var left bool
	require.NoError(t, admin.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&left))
	assert.False(t, left, "schema %s is left on the server; errors: %q", schema, rec.errors)
}
