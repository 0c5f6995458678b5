package idempotency_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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

// AcquireTimeout bounds the wait for a connection, not the request: a
// request whose connection comes within the bound is served as any other,
// and a handler that runs longer than the bound is not cut.
func TestAcquireTimeoutBoundsOnlyTheWaitForAConnection(t *testing.T) {
	t.Run("the connection comes within the bound", func(t *testing.T) {
		t.Parallel()
		pool, schema := pgtest.Schema(t)
		ctx := context.Background()
		require.NoError(t, idempotency.Migrate(ctx, pool, schema))
		_, err := pool.Exec(ctx, `CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, body text NOT NULL)`)
		require.NoError(t, err)
		acquiring := &acquireSignal{started: make(chan struct{}, 1)}
		small := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
			c.MaxConns = 1
			c.ConnConfig.Tracer = acquiring
		})
		s := serve(t, small, schema, idempotency.Config{AcquireTimeout: time.Minute}, http.HandlerFunc(insertEffect))
		s.pool = pool

		// The tracer tells when the request asks the pool, not when it
		// starts to wait: the release can come first, and then the
		// request did not wait. Each try is served; at least one must
		// have waited.
		waited, tries := false, 0
		for ; tries < 10 && !waited; tries++ {
			held, err := small.Acquire(ctx)
			require.NoError(t, err)
			acquiring.arm()
			answered := make(chan reply, 1)
			key := fmt.Sprintf("k%d", tries)
			go func() { answered <- s.post("/orders", key, "b") }()
			select {
			case <-acquiring.started:
			case <-time.After(30 * time.Second):
				held.Release()
				t.Fatal("the request never asked the pool for a connection")
			}
			before := small.Stat().EmptyAcquireCount()
			held.Release() // while the request waits for it, mostly
			r := <-answered
			require.Equal(t, http.StatusCreated, r.status, r.body)
			waited = small.Stat().EmptyAcquireCount() > before
		}
		assert.True(t, waited, "no request waited for the held connection in %d tries", tries)
		assert.Equal(t, tries, s.effects())
		assert.Equal(t, tries, s.keys())
		assert.True(t, s.post("/orders", "k0", "b").replayed())
		assert.Equal(t, tries, s.effects())
	})
	t.Run("a handler longer than the bound", func(t *testing.T) {
		t.Parallel()
		const bound = 200 * time.Millisecond
		slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			// Three times the bound inside the request's transaction.
			if _, err := idempotency.Tx(r.Context()).Exec(r.Context(), `SELECT pg_sleep(0.6)`); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			insertEffect(w, r)
		})
		for _, key := range []string{"k", ""} {
			s := newService(t, idempotency.Config{Optional: true, AcquireTimeout: bound}, slow)
			started := time.Now()
			r := s.post("/orders", key, "b")
			require.Equal(t, http.StatusCreated, r.status, "key %q: %s", key, r.body)
			assert.Greater(t, time.Since(started), 3*bound)
			assert.Equal(t, 1, s.effects())
		}
	})
}

// acquireSignal is a pgx tracer that signals the first pool Acquire that
// starts after it is armed (pgxpool calls it before it waits for a
// connection).
type acquireSignal struct {
	armed   atomic.Bool
	started chan struct{}
}

func (a *acquireSignal) arm() { a.armed.Store(true) }

func (a *acquireSignal) TraceAcquireStart(ctx context.Context, _ *pgxpool.Pool, _ pgxpool.TraceAcquireStartData) context.Context {
	if a.armed.CompareAndSwap(true, false) {
		select {
		case a.started <- struct{}{}:
		default:
		}
	}
	return ctx
}

func (*acquireSignal) TraceAcquireEnd(context.Context, *pgxpool.Pool, pgxpool.TraceAcquireEndData) {}

func (*acquireSignal) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (*acquireSignal) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

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
