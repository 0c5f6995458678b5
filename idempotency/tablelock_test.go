package idempotency_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

// A new key is never in flight, also while the table is briefly locked
// (autovacuum truncating its empty tail, a DDL statement, a REINDEX): the
// claim waits for that lock as any statement would, and only the wait for
// the same key is bounded by Config.Wait.
func TestNewKeyWaitsOutATableLock(t *testing.T) {
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	admin := s.pool
	// One connection, whose statements are prepared by a first request.
	s = serve(t, pgtest.NewPoolWith(t, s.schema, func(c *pgxpool.Config) { c.MaxConns = 1 }), s.schema,
		idempotency.Config{}, http.HandlerFunc(insertEffect))
	s.pool = admin
	require.Equal(t, http.StatusCreated, s.post("/orders", "first", "a").status)
	ctx := context.Background()
	locker, err := s.pool.Begin(ctx)
	require.NoError(t, err)
	defer locker.Rollback(ctx) //nolint:errcheck
	_, err = locker.Exec(ctx, `LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)

	got := make(chan reply, 1)
	go func() { got <- s.post("/orders", "fresh", "b") }()
	waiting := func() bool {
		return count(t, s.pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
			AND wait_event = 'relation' AND strpos(query, '"' || $1 || '"."idempotency_keys"') > 0`, s.schema) == 1
	}
	for !waiting() {
		select {
		case r := <-got:
			require.NoError(t, locker.Rollback(ctx))
			t.Fatalf("the request ended while the table was locked: %d %s", r.status, r.body)
		case <-time.After(5 * time.Millisecond):
		}
	}
	require.NoError(t, locker.Commit(ctx))
	r := <-got
	assert.Equal(t, http.StatusCreated, r.status, r.body)
	assert.Equal(t, 2, s.effects())
}

// A server lock_timeout (the session's, which the middleware leaves to the
// table's locks and the handler's statements) that expires while a new
// key's claim waits for the table is a transient failure, 503 with
// Retry-After, never a 409: no other request holds that key.
func TestSessionLockTimeoutOnTheTableIsNot409(t *testing.T) {
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	admin := s.pool
	s = serve(t, pgtest.NewPoolWith(t, s.schema, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["lock_timeout"] = "200ms"
	}), s.schema, idempotency.Config{Wait: time.Minute}, http.HandlerFunc(insertEffect))
	s.pool = admin
	require.Equal(t, http.StatusCreated, s.post("/orders", "first", "a").status)
	ctx := context.Background()
	for _, mode := range []string{"ACCESS EXCLUSIVE", "SHARE"} { // the lock statement's wait, the insert's
		locker, err := s.pool.Begin(ctx)
		require.NoError(t, err)
		_, err = locker.Exec(ctx, `LOCK TABLE idempotency_keys IN `+mode+` MODE`)
		require.NoError(t, err)
		r := s.post("/orders", "fresh "+mode, "b")
		require.NoError(t, locker.Rollback(ctx))
		assert.Equal(t, http.StatusServiceUnavailable, r.status, "%s: %s", mode, r.body)
		assert.Equal(t, "1", r.header.Get("Retry-After"), mode)
	}
	assert.Equal(t, http.StatusCreated, s.post("/orders", "fresh", "b").status)
}
