package idempotency_test

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
)

// A handler that ends the request's transaction with SQL of its own
// (ROLLBACK, where Rollback refuses) takes the key's claim with it: its
// later writes commit one by one, and nothing records the key. It was
// answered 201 and its retry ran again; it gets 500 now, and the misuse
// is logged.
func TestHandlerEndingTheTransactionBySQLIsNotASuccess(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		_, err := idempotency.Tx(r.Context()).Exec(r.Context(), `ROLLBACK`)
		require.NoError(t, err)
		insertEffect(w, r)
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
	first := s.post("/orders", "k", "b")
	again := s.post("/orders", "k", "b")
	assert.Equal(t, http.StatusInternalServerError, first.status, "%s", first.body)
	assert.False(t, first.status < 300 && !again.replayed(), "answered %d, and the retry ran again: %d %s", first.status, again.status, again.body)
}
