package idempotency_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

// readOnlyService is a middleware in front of insertEffect on a pool of
// two connections, both of which reach a server that has become
// read-only, as after a failover that demoted the primary they were
// opened to. adjust changes the pool's configuration.
func readOnlyService(t *testing.T, cfg idempotency.Config, adjust func(*pgxpool.Config)) (*service, *warnLog) {
	t.Helper()
	admin, schema := pgtest.Schema(t)
	ctx := context.Background()
	require.NoError(t, idempotency.Migrate(ctx, admin, schema))
	_, err := admin.Exec(ctx, `CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, body text NOT NULL)`)
	require.NoError(t, err)
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		c.MaxConns = 2
		if adjust != nil {
			adjust(c)
		}
	})
	pgtest.TurnReadOnly(t, pool)
	logs := &warnLog{}
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	s := serve(t, pool, schema, cfg, http.HandlerFunc(insertEffect))
	s.pool = admin
	return s, logs
}

// After a failover, the connections the pool kept reached the demoted
// primary, read-only now: every claim drawn on one failed with 25006 and
// got 503, until the pool retired them (MaxConnLifetime, an hour by
// default). The first refusal closes the pool's connections and the claim
// is made again on a new connection, before the handler runs: each
// request is served, and its effect happens once.
func TestReadOnlyConnectionsAfterAFailoverAreNotReusedForever(t *testing.T) {
	s, logs := readOnlyService(t, idempotency.Config{}, nil)
	for i := range 4 {
		r := s.post("/orders", fmt.Sprintf("k%d", i), "b")
		assert.Equal(t, http.StatusCreated, r.status, "request %d: %q", i, r.body)
	}
	assert.Equal(t, 4, s.effects())
	assert.Equal(t, 4, s.keys())
	assert.Contains(t, logs.text(), "refused a write as read-only")
}

// A server that is still read-only on a new connection (the database
// itself made read-only, or the connection string still names a standby)
// gets 503 with Retry-After, as any database unavailable, and the handler
// does not run.
func TestReadOnlyServerGets503(t *testing.T) {
	s, _ := readOnlyService(t, idempotency.Config{}, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	})
	r := s.post("/orders", "k", "b")
	assert.Equal(t, http.StatusServiceUnavailable, r.status, "%q", r.body)
	assert.NotEmpty(t, r.header.Get("Retry-After"))
	assert.Equal(t, 0, s.effects())
	assert.Equal(t, 0, s.keys())
}

// Retention on a pool whose connections reach a demoted primary closes
// them as requests do: its next sweep, on a new connection, deletes the
// expired keys, where every sweep failed before.
func TestRetentionLeavesReadOnlyConnections(t *testing.T) {
	s, logs := readOnlyService(t, idempotency.Config{RetentionInterval: 10 * time.Millisecond}, nil)
	ctx := context.Background()
	_, err := s.pool.Exec(ctx, `INSERT INTO idempotency_keys (scope, idempotency_key, fingerprint, method, path, expires_at)
		VALUES ('', 'old', ''::bytea, 'POST', '/orders', now() - interval '1 second')`)
	require.NoError(t, err)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- s.mw.RunRetention(rctx) }()
	assert.Eventually(t, func() bool { return s.keys() == 0 }, 10*time.Second, 10*time.Millisecond,
		"the expired key is still there; the log ends:\n%s", lastLines(logs.text(), 3))
	cancel()
	assert.ErrorIs(t, <-done, context.Canceled)
	assert.Contains(t, logs.text(), "refused a write as read-only")
}

// lastLines returns the last n lines of text.
func lastLines(text string, n int) string {
	lines := strings.Split(strings.TrimRight(text, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// A request without a key (Config.Optional) makes no claim: its handler's
// own write meets the read-only server, and it fails. Before, every such
// request drawn on a connection to the demoted primary failed so until the
// pool retired it (MaxConnLifetime, an hour by default), since nothing of
// the middleware's saw a 25006. The server tells each session its
// default_transaction_read_only and in_hot_standby (PostgreSQL 14 and
// later); a request whose transaction did not commit on a connection that
// says read-only closes the pool's connections, and the next requests run
// on new ones.
func TestRequestsWithoutAKeyLeaveReadOnlyConnections(t *testing.T) {
	s, logs := readOnlyService(t, idempotency.Config{Optional: true}, nil)
	first := s.post("/orders", "", "b")
	assert.Equal(t, http.StatusInternalServerError, first.status,
		"the handler's write on a read-only connection fails: %q", first.body)
	for i := range 4 {
		r := s.post("/orders", "", fmt.Sprintf("b%d", i))
		assert.Equal(t, http.StatusCreated, r.status, "request %d after the first: %q", i, r.body)
	}
	assert.Equal(t, 4, s.effects())
	assert.Contains(t, logs.text(), "read-only")
}

// The guard: a request without a key that fails on a writable session
// (its handler's own error) leaves the pool's connections alone.
func TestFailedRequestWithoutAKeyOnAWritableSessionKeepsThePool(t *testing.T) {
	_, schema := pgtest.Schema(t)
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.MaxConns = 2 })
	logs := &warnLog{}
	cfg := idempotency.Config{Optional: true, Logger: slog.New(slog.NewTextHandler(logs, nil))}
	s := serve(t, pool, schema, cfg, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, err := idempotency.Tx(r.Context()).Exec(r.Context(), `SELECT 1/0`)
		http.Error(w, err.Error(), http.StatusInternalServerError)
	}))
	s.post("/orders", "", "b") // opens the pool's first connection
	opened := pool.Stat().NewConnsCount()
	for range 3 {
		r := s.post("/orders", "", "b")
		assert.Equal(t, http.StatusInternalServerError, r.status, "%q", r.body)
	}
	assert.NotContains(t, logs.text(), "read-only")
	assert.Equal(t, opened, pool.Stat().NewConnsCount(), "connections were opened anew")
}
