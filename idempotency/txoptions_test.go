package idempotency_test

import (
	"net/http"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"

	"github.com/onceco/once/idempotency"
)

// Config.TxOptions are the options of every request's transaction, also of
// a request without a key under Optional.
func TestOptionalRequestRunsUnderTxOptions(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		var level string
		if err := idempotency.Tx(r.Context()).QueryRow(r.Context(), `SHOW transaction_isolation`).Scan(&level); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		_, _ = w.Write([]byte(level))
	}
	s := newService(t, idempotency.Config{Optional: true, TxOptions: pgx.TxOptions{IsoLevel: pgx.Serializable}},
		http.HandlerFunc(h))
	withKey := s.post("/orders", "k", "b")
	assert.Equal(t, "serializable", withKey.body)
	withoutKey := s.post("/orders", "", "b")
	assert.Equal(t, http.StatusOK, withoutKey.status)
	assert.Equal(t, "serializable", withoutKey.body)
}
