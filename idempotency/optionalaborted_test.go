package idempotency_test

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/onceco/once/idempotency"
)

// The same as TestFailedStatementIsNotCommitted for a request without a
// key under Optional: a handler that answers its failed statement with a
// 4xx has its answer sent, and one that answers success gets a 500.
// Without a key nothing of the middleware's runs between the handler and
// the COMMIT, which pgx answers on an aborted transaction with
// pgx.ErrTxCommitRollback, not 25P02: the honest 4xx was replaced with
// "500 Transaction aborted", logged as a handler that answered success.
func TestFailedStatementWithoutAKeyKeepsTheHandlers4xx(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		tx := idempotency.Tx(r.Context())
		_, _ = tx.Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ('x', '')`)
		_, err := tx.Exec(r.Context(), `INSERT INTO no_such_table VALUES (1)`)
		if r.URL.Path == "/honest" {
			http.Error(w, err.Error(), http.StatusUnprocessableEntity)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}
	s := newService(t, idempotency.Config{Optional: true}, http.HandlerFunc(h))
	assert.Equal(t, http.StatusInternalServerError, s.post("/lying", "", "b").status)
	r := s.post("/honest", "", "b")
	assert.Equal(t, http.StatusUnprocessableEntity, r.status, r.body)
	assert.Contains(t, r.body, "no_such_table")
	assert.Equal(t, 0, s.effects())
}
