package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
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
