package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
)

// A request whose context ends between two of its handler's statements
// (the client gone, an outer middleware's deadline passed): pgx refuses
// the second statement without sending it ("context canceled"), so the
// transaction is not aborted and holds the first statement's write. A
// handler that answers the error with a 4xx, as the documented service
// does, must not get half its effect committed and the cancellation
// stored as the key's answer, replayed to every retry for the TTL: the
// request is rolled back and answered 503, and the retry runs it whole.
// Without a key (Optional) there is no replay, but the half effect is
// the same.
func TestContextEndedMidHandlerCommitsNoHalfEffect(t *testing.T) {
	for _, key := range []string{"k", ""} {
		t.Run("key "+strconv.Quote(key), func(t *testing.T) {
			s, hurried := newCancelingService(t)
			r := hurried.post("/transfers", key, "10")
			assert.Equal(t, http.StatusServiceUnavailable, r.status, "%q", r.body)
			assert.Equal(t, "1", r.header.Get("Retry-After"))
			assert.Equal(t, 0, s.effects(), "half the effect committed")
			assert.Equal(t, 0, s.keys())

			again := hurried.post("/transfers", key, "10")
			require.Equal(t, http.StatusCreated, again.status, "%q", again.body)
			assert.False(t, again.replayed())
			assert.Equal(t, 2, s.effects())
		})
	}
}

// newCancelingService serves a handler that writes an effect in two
// statements, behind the middleware (Optional) and an outer middleware
// whose deadline, for the first request only, passes between them.
func newCancelingService(t *testing.T) (*service, *service) {
	var canceled atomic.Bool
	type cancelKey struct{}
	withDeadline := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx, cancel := context.WithCancel(r.Context())
			defer cancel()
			next.ServeHTTP(w, r.WithContext(context.WithValue(ctx, cancelKey{}, cancel)))
		})
	}
	h := func(w http.ResponseWriter, r *http.Request) {
		tx := idempotency.Tx(r.Context())
		for i, body := range []string{"debit", "credit"} {
			if i == 1 && canceled.CompareAndSwap(false, true) {
				r.Context().Value(cancelKey{}).(context.CancelFunc)()
			}
			if _, err := tx.Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ($1, $2)`, idempotency.Key(r.Context()), body); err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest) // as the documented service answers
				return
			}
		}
		w.WriteHeader(http.StatusCreated)
	}
	s := newService(t, idempotency.Config{Optional: true}, http.HandlerFunc(h))
	srv := httptest.NewServer(withDeadline(s.mw.Handler(http.HandlerFunc(h))))
	t.Cleanup(srv.Close)
	return s, &service{t: t, pool: s.pool, schema: s.schema, mw: s.mw, url: srv.URL, client: client}
}
