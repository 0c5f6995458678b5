package idempotency_test

import (
	"context"
	"net/http"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/netcut"
	"github.com/onceco/once/internal/pgtest"
)

// pauseAfterBatch is a pgx tracer that, once armed, holds the connection's
// traffic to the server (through the proxy) as soon as a batch ended: the
// database stops answering right after a request's claim.
type pauseAfterBatch struct {
	proxy *netcut.Proxy
	armed atomic.Bool
}

func (p *pauseAfterBatch) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (p *pauseAfterBatch) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (p *pauseAfterBatch) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (p *pauseAfterBatch) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (p *pauseAfterBatch) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {
	if p.armed.CompareAndSwap(true, false) {
		p.proxy.Pause()
	}
}

// The database stops answering right after a replay's claim: the request
// still gets its replay once the rollback of its read-only transaction
// gives up, within the middleware's bound, instead of waiting for the
// connection without end (and holding it) after its answer was known.
func TestReplayWhileTheDatabaseHangsEnds(t *testing.T) {
	defer idempotency.SetFinishTimeout(time.Second)()
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	first := s.post("/orders", "k", "b")
	require.Equal(t, http.StatusCreated, first.status)

	u, err := url.Parse(pgtest.URL())
	require.NoError(t, err)
	proxy, err := netcut.NewProxy(u.Host)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	u.Host = proxy.Addr()
	cfg, err := pgxpool.ParseConfig(u.String())
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = s.schema
	tracer := &pauseAfterBatch{proxy: proxy}
	cfg.ConnConfig.Tracer = tracer
	hanging, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(hanging.Close)
	viaProxy := serve(t, hanging, s.schema, idempotency.Config{}, http.HandlerFunc(insertEffect))
	viaProxy.client = noRetryClient

	tracer.armed.Store(true)
	got := make(chan reply, 1)
	go func() { got <- viaProxy.post("/orders", "k", "b") }()
	var r reply
	select {
	case r = <-got:
	case <-time.After(20 * time.Second):
		t.Error("the replay waited for a database that stopped answering")
		proxy.Resume()
		r = <-got
		proxy.Pause() // for the Resume below
	}
	require.False(t, tracer.armed.Load(), "the claim's batch ended")
	proxy.Resume()
	assert.True(t, r.replayed(), "%d %s", r.status, r.body)
	assert.Equal(t, first.body, r.body)
}
