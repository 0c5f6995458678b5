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
		commitEffectBySQL(t, r)
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

// A handler that commits the request's transaction by SQL and then panics
// (a nil map in the code that renders its answer) made the claim, still
// without a response, permanent with the effect: the panic skipped the
// storing of any response, and every retry with the key got 500 "Stored
// response missing" for the whole TTL, logged as a table written behind
// the middleware's back, the client never told that its effect happened.
// A response saying so is stored before the panic goes on, and the retry
// replays it; the effect stays once.
func TestHandlerPanickingAfterCommittingBySQLLeavesNoKeyWithoutAResponse(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		commitEffectBySQL(t, r)
		panic(http.ErrAbortHandler) // net/http closes the connection quietly
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
	s.client = noRetryClient
	_, err := s.tryPost("/orders", "k", "b")
	require.Error(t, err, "the connection is closed")
	again := s.post("/orders", "k", "b")
	assert.Equal(t, 1, s.effects())
	assert.Zero(t, count(t, s.pool, `SELECT count(*) FROM idempotency_keys WHERE status = 0`),
		"a committed key without a response")
	assert.True(t, again.replayed(), "the retry: %d %s", again.status, again.body)
	assert.Contains(t, again.body, "committed", "the retry learns that the effect happened")
}

// A handler that commits the request's transaction by SQL and then writes
// a body over MaxResponseBytes: the too-large response was answered 500
// before anything was stored, so the committed claim stayed without a
// response, and every retry got 500 "Stored response missing" for the
// whole TTL. A 500 saying that the effect committed is stored and
// replayed.
func TestHandlerCommittingBySQLWithATooLargeResponseLeavesNoKeyWithoutAResponse(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		commitEffectBySQL(t, r)
		_, _ = w.Write(make([]byte, 200))
	}
	s := newService(t, idempotency.Config{MaxResponseBytes: 100}, http.HandlerFunc(h))
	first := s.post("/orders", "k", "b")
	again := s.post("/orders", "k", "b")
	assert.Equal(t, 1, s.effects())
	assert.Zero(t, count(t, s.pool, `SELECT count(*) FROM idempotency_keys WHERE status = 0`),
		"a committed key without a response")
	assert.Contains(t, first.body, "committed", "the client learns that the effect happened")
	assert.True(t, again.replayed(), "the retry: %d %s", again.status, again.body)
	assert.Equal(t, first.body, again.body)
}

// commitEffectBySQL writes the effect of r and commits the request's
// transaction by SQL, as a helper handed Tx(ctx).Conn() does: a BEGIN on
// the connection (PostgreSQL only warns about it), the write, a COMMIT.
func commitEffectBySQL(t *testing.T, r *http.Request) {
	inner, err := idempotency.Tx(r.Context()).Conn().Begin(r.Context())
	require.NoError(t, err)
	_, err = inner.Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ('k', 'b')`)
	require.NoError(t, err)
	require.NoError(t, inner.Commit(r.Context()))
}
