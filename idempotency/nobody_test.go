package idempotency_test

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
)

// A response without a body (204 No Content, a 202 or 201 with only a
// Location, a 304) is stored and replayed like any other. The empty body
// went to the table as NULL, which the body column refuses: every such
// request got 500 and its effect was rolled back.
func TestResponseWithoutABodyIsStored(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		_, err := idempotency.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ($1, '')`, idempotency.Key(r.Context()))
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		switch r.URL.Path {
		case "/accepted":
			w.Header().Set("Location", "/jobs/1")
			w.WriteHeader(http.StatusAccepted)
		case "/nothing": // net/http's 200
		default:
			w.WriteHeader(http.StatusNoContent)
		}
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
	for path, status := range map[string]int{"/delete": http.StatusNoContent, "/accepted": http.StatusAccepted, "/nothing": http.StatusOK} {
		first := s.post(path, "k"+path, "b")
		require.Equal(t, status, first.status, "%s: %s", path, first.body)
		again := s.post(path, "k"+path, "b")
		assert.Equal(t, status, again.status, path)
		assert.True(t, again.replayed(), path)
		assert.Empty(t, again.body, path)
	}
	assert.Equal(t, "/jobs/1", s.post("/accepted", "k/accepted", "b").header.Get("Location"))
	assert.Equal(t, 3, s.effects())
}
