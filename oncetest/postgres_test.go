package oncetest_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

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
