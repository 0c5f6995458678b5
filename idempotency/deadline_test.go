package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

// A request whose context ends while it waits for its key (a deadline an
// outer middleware set, shorter than Config.Wait) was not processed: it
// gets 503 with Retry-After, never an empty success.
func TestRequestDeadlineWhileWaitingGets503(t *testing.T) {
	g := newGate()
	s := newService(t, idempotency.Config{Wait: time.Minute}, g.wrap(insertEffect))
	withDeadline := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx, cancel := context.WithTimeout(r.Context(), 200*time.Millisecond)
			defer cancel()
			next.ServeHTTP(w, r.WithContext(ctx))
		})
	}
	srv := httptest.NewServer(withDeadline(s.mw.Handler(http.HandlerFunc(insertEffect))))
	t.Cleanup(srv.Close)
	hurried := &service{t: t, pool: s.pool, schema: s.schema, mw: s.mw, url: srv.URL, client: client}

	first := make(chan reply, 1)
	go func() { first <- s.post("/orders", "k", "b") }()
	g.waitEntered(t)
	r := hurried.post("/orders", "k", "b") // waits on the first's key until its deadline
	assert.Equal(t, http.StatusServiceUnavailable, r.status, "%q", r.body)
	assert.Equal(t, "1", r.header.Get("Retry-After"))
	close(g.open)
	got := <-first
	require.Equal(t, http.StatusCreated, got.status, got.body)
	again := hurried.post("/orders", "k", "b")
	assert.True(t, again.replayed())
	assert.Equal(t, got.body, again.body)
	assert.Equal(t, 1, s.effects())
}

// A server statement_timeout shorter than Config.Wait ends the wait for a
// key in flight: the request was not processed, and gets 503 with
// Retry-After, as for any transient database failure; the retry after the
// first request commits is its replay.
func TestStatementTimeoutWhileWaitingGets503(t *testing.T) {
	g := newGate()
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	timed := pgtest.NewPoolWith(t, s.schema, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["statement_timeout"] = "300ms"
	})
	hurried := serve(t, timed, s.schema, idempotency.Config{Wait: time.Minute}, g.wrap(insertEffect))
	hurried.pool = s.pool

	first := make(chan reply, 1)
	go func() { first <- hurried.post("/orders", "k", "b") }()
	g.waitEntered(t)
	r := hurried.post("/orders", "k", "b") // waits on the first's key until the server cancels it
	assert.Equal(t, http.StatusServiceUnavailable, r.status, "%q", r.body)
	assert.Equal(t, "1", r.header.Get("Retry-After"))
	close(g.open)
	got := <-first
	require.Equal(t, http.StatusCreated, got.status, got.body)
	again := hurried.post("/orders", "k", "b")
	assert.True(t, again.replayed())
	assert.Equal(t, got.body, again.body)
	assert.Equal(t, 1, s.effects())
}
