package idempotency_test

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
)

// A handler that hands the request's connection to code written for a
// *pgx.Conn (Tx(ctx).Conn(), then conn.Begin and Commit, as a repository
// helper does) commits the request's transaction by SQL: PostgreSQL only
// warns about the nested BEGIN. The key's claim, still without a response
// (status 0), committed with the effect. When the handler then answered
// 5xx, the middleware "rolled back" a transaction that was over: the
// effect stayed, and every retry with the key got 500 "Stored response
// missing" until the TTL ran out, the client never learning that its
// payment happened. The claim must never be left committed without a
// response: the answer the client got is stored, and the retry replays it.
func TestHandlerCommittingBySQLLeavesNoKeyWithoutAResponse(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		inner, err := idempotency.Tx(r.Context()).Conn().Begin(r.Context())
		require.NoError(t, err)
		_, err = inner.Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ('k', 'b')`)
		require.NoError(t, err)
		require.NoError(t, inner.Commit(r.Context()))
		http.Error(w, "the downstream call failed", http.StatusBadGateway)
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
	first := s.post("/orders", "k", "b")
	again := s.post("/orders", "k", "b")
	assert.Equal(t, 1, s.effects())
	assert.Zero(t, count(t, s.pool, `SELECT count(*) FROM idempotency_keys WHERE status = 0`),
		"a committed key without a response")
	assert.NotEqual(t, http.StatusInternalServerError, again.status, "the retry: %s", again.body)
	assert.Equal(t, first.status, again.status, "the retry of a request whose effect committed gets what the first got")
	assert.True(t, again.replayed())
}
