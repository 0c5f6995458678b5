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

// A WriteHeader after the response's status was written is superfluous:
// net/http logs it and ignores its code, whatever it is, before checking
// it. A handler whose error path writes a status once more after its 201
// (a generic error mapper answering 0 for no error) succeeds under
// net/http; the buffered writer panicked on the 0, rolling back a request
// that had answered, at every retry.
func TestSuperfluousInvalidStatusIsIgnoredAsNetHTTPIgnoresIt(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		insertEffect(w, r)
		w.WriteHeader(0) // superfluous: the 201 went first
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
	s.client = noRetryClient
	r, err := s.tryPost("/orders", "k", "b")
	require.NoError(t, err, "the handler answered 201 before its superfluous WriteHeader")
	assert.Equal(t, http.StatusCreated, r.status, r.body)
	again, err := s.tryPost("/orders", "k", "b")
	require.NoError(t, err)
	assert.True(t, again.replayed())
	assert.Equal(t, r.body, again.body)
	assert.Equal(t, 1, s.effects())
}
