package idempotency_test

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

// A request waited for a pool connection for as long as its client
// waited: under pool pressure every request held its goroutine and its
// client, with nothing in the logs, until the pool freed a connection or
// the client gave up. It waits at most Config.AcquireTimeout (5 s by
// default), then gets 503 with Retry-After and is logged at Warn; a retry
// once the pool has room is served, and the handler's effect happens
// once.
func TestPoolExhaustedGets503WithinAcquireTimeout(t *testing.T) {
	for _, tc := range []struct {
		name    string
		timeout time.Duration
	}{{"default", 0}, {"configured", 300 * time.Millisecond}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool, schema := pgtest.Schema(t)
			ctx := context.Background()
			require.NoError(t, idempotency.Migrate(ctx, pool, schema))
			_, err := pool.Exec(ctx, `CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, body text NOT NULL)`)
			require.NoError(t, err)
			small := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.MaxConns = 1 })
			held, err := small.Acquire(ctx)
			require.NoError(t, err)
			defer held.Release()
			logs := &warnLog{}
			s := serve(t, small, schema, idempotency.Config{AcquireTimeout: tc.timeout, Logger: slog.New(slog.NewTextHandler(logs, nil))}, http.HandlerFunc(insertEffect))
			s.pool = pool

			answered := make(chan reply, 1)
			started := time.Now()
			go func() { answered <- s.post("/orders", "k", "b") }()
			var r reply
			select {
			case r = <-answered:
			case <-time.After(20 * time.Second):
				t.Fatal("the request still waits for a pool connection")
			}
			took := time.Since(started)
			assert.Equal(t, http.StatusServiceUnavailable, r.status, "%q", r.body)
			assert.Equal(t, "1", r.header.Get("Retry-After"))
			want := tc.timeout
			if want == 0 {
				want = idempotency.DefaultAcquireTimeout
			}
			assert.GreaterOrEqual(t, took, want, "answered before the bound")
			assert.Contains(t, logs.text(), "AcquireTimeout")

			held.Release()
			again := s.post("/orders", "k", "b")
			require.Equal(t, http.StatusCreated, again.status, again.body)
			assert.Equal(t, 1, s.effects())
			assert.True(t, s.post("/orders", "k", "b").replayed())
		})
	}
	t.Run("without a key (Optional)", func(t *testing.T) {
		t.Parallel()
		pool, schema := pgtest.Schema(t)
		ctx := context.Background()
		require.NoError(t, idempotency.Migrate(ctx, pool, schema))
		small := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.MaxConns = 1 })
		held, err := small.Acquire(ctx)
		require.NoError(t, err)
		defer held.Release()
		ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) })
		s := serve(t, small, schema, idempotency.Config{Optional: true, AcquireTimeout: 300 * time.Millisecond}, ok)
		r := s.post("/orders", "", "b")
		assert.Equal(t, http.StatusServiceUnavailable, r.status, "%q", r.body)
		held.Release()
		assert.Equal(t, http.StatusNoContent, s.post("/orders", "", "b").status)
	})
}

// warnLog is an io.Writer for a slog.TextHandler that keeps what is
// logged; safe for concurrent use.
type warnLog struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (l *warnLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *warnLog) text() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}
