package idempotency_test

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
)

// A status net/http refuses (below 100 or above 999: a handler's map of
// errors to statuses that lacks the error, and answers 0) panics in
// WriteHeader, as net/http's own writer does, so that the request rolls
// back: the buffered writer took 0 for no status at all, committed the
// handler's effect and stored a 200 whose body is the handler's error,
// replayed to every retry as a success.
func TestInvalidStatusIsNotASuccess(t *testing.T) {
	for _, status := range []int{0, 99, 1000} {
		h := func(w http.ResponseWriter, r *http.Request) {
			_, err := idempotency.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ('x', '')`)
			assert.NoError(t, err)
			w.WriteHeader(status)
			_, _ = w.Write([]byte("payment declined"))
		}
		s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
		s.client = noRetryClient
		r, err := s.tryPost("/orders", "k", "b")
		require.Error(t, err, "status %d: the connection is closed, as net/http closes it on the handler's panic; got %d %q", status, r.status, r.body)
		assert.Equal(t, 0, s.effects(), "status %d", status)
		assert.Equal(t, 0, s.keys(), "status %d", status)
	}
}
