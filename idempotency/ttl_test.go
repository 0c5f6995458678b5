package idempotency_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
)

// The TTL of a stored response counts from when it is stored, not from
// when its request began: a request that ran longer than the TTL (a slow
// handler, a lock it waited on) stores a response that a retry sent right
// after gets as a replay, not one already expired that runs the handler
// again and doubles its effect.
func TestTTLStartsWhenTheResponseIsStored(t *testing.T) {
	const ttl = 2 * time.Second
	slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The handler's own work outlasts the TTL.
		if _, err := idempotency.Tx(r.Context()).Exec(r.Context(), `SELECT pg_sleep(2.5)`); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		insertEffect(w, r)
	})
	s := newService(t, idempotency.Config{TTL: ttl}, slow)
	first := s.post("/orders", "k", "b")
	answered := time.Now()
	require.Equal(t, http.StatusCreated, first.status, first.body)
	var expires time.Time
	require.NoError(t, s.pool.QueryRow(context.Background(), `SELECT expires_at FROM idempotency_keys`).Scan(&expires))
	assert.WithinDuration(t, answered.Add(ttl), expires, time.Second, "the TTL counts from the response")

	retried := time.Now()
	again := s.post("/orders", "k", "b")
	require.Less(t, retried.Sub(answered), ttl, "the retry was sent within the TTL of the response")
	assert.True(t, again.replayed(), "a retry within the TTL of the response is a replay")
	assert.Equal(t, first.body, again.body)
	assert.Equal(t, 1, s.effects(), "one effect")
}
