package idempotency_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
)

// A request that reuses an expired key deletes the expired row in its
// transaction and claims the key again; while its handler runs, the old
// row is locked. Retention does not wait for that request: it would hold
// its batch's other rows (and every request with one of those keys) for
// as long as the handler runs, without bound when the handler hangs.
func TestRetentionDoesNotWaitForARequestReusingAnExpiredKey(t *testing.T) {
	g := newGate()
	var calls atomic.Int32
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 2 {
			g.wrap(insertEffect)(w, r)
			return
		}
		insertEffect(w, r)
	})
	s := newService(t, idempotency.Config{TTL: time.Millisecond}, h)
	require.Equal(t, http.StatusCreated, s.post("/orders", "k", "b").status)
	deadline := time.Now().Add(10 * time.Second)
	for count(t, s.pool, `SELECT count(*) FROM idempotency_keys WHERE expires_at <= now()`) != 1 {
		require.True(t, time.Now().Before(deadline), "the key never expired")
		time.Sleep(5 * time.Millisecond)
	}

	second := make(chan reply, 1)
	go func() { second <- s.post("/orders", "k", "b") }()
	g.waitEntered(t) // the expired row is deleted, uncommitted, and k claimed again

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	n, err := s.mw.DeleteExpired(ctx)
	elapsed := time.Since(start)
	close(g.open)
	require.NoError(t, err, "retention waited %v for the request's row", elapsed)
	assert.Zero(t, n, "the locked row is the request's to delete")
	assert.Less(t, elapsed, 5*time.Second)

	r := <-second
	assert.Equal(t, http.StatusCreated, r.status, r.body)
	assert.Equal(t, 2, s.effects())
}
