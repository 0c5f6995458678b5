package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

// A body limit set in front of the middleware (http.MaxBytesHandler, a
// gateway's own) is met by the middleware's read of the body: the 413 must
// name that limit, the one the client passed. It named MaxRequestBytes
// (1 MiB by default), telling a client refused at 1,000 bytes that its
// body exceeded 1,048,576 bytes.
func TestOuterBodyLimitIsTheOneThe413Names(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	require.NoError(t, idempotency.Migrate(context.Background(), pool, schema))
	mw, err := idempotency.New(pool, idempotency.Config{Scope: idempotency.SingleScope, Schema: schema})
	require.NoError(t, err)
	var ran atomic.Bool
	h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { ran.Store(true) }))
	srv := httptest.NewServer(http.MaxBytesHandler(h, 1000))
	t.Cleanup(srv.Close)
	s := &service{t: t, pool: pool, schema: schema, mw: mw, url: srv.URL, client: client}

	r := s.post("/orders", "k", strings.Repeat("b", 2000))
	assert.Equal(t, http.StatusRequestEntityTooLarge, r.status, r.body)
	assert.Contains(t, r.body, "exceeds 1000 bytes")
	assert.NotContains(t, r.body, "1048576")
	assert.False(t, ran.Load())
	assert.Equal(t, 0, s.keys())
}
