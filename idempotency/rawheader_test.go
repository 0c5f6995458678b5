package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
)

// A stored header whose value is not UTF-8 (an ETag or a filename with
// obs-text bytes, which HTTP allows) replays with the bytes the first
// response had. The headers are kept as JSON, whose strings cannot hold
// such bytes: each was replaced by U+FFFD, and the replay's ETag matched
// nothing the first response had announced.
func TestStoredHeaderBytesReplayAsSent(t *testing.T) {
	const etag = "\"caf\xe9\""
	h := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("ETag", etag)
		w.Header().Add("Content-Language", "de")
		w.Header().Add("Content-Language", "fr\xff")
		w.Header().Set("Content-Location", "/caf\xc3\xa9") // UTF-8: kept as it is
		insertEffect(w, r)
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
	first := s.post("/orders", "k", "b")
	require.Equal(t, http.StatusCreated, first.status, first.body)
	require.Equal(t, etag, first.header.Get("ETag"))
	again := s.post("/orders", "k", "b")
	require.True(t, again.replayed())
	assert.Equal(t, etag, again.header.Get("ETag"))
	assert.Equal(t, []string{"de", "fr\xff"}, again.header.Values("Content-Language"))
	assert.Equal(t, "/caf\xc3\xa9", again.header.Get("Content-Location"))
	for name := range again.header {
		assert.NotContains(t, name, ":", "no header of the middleware's own")
	}
}

// A stored header whose value holds a NUL byte (valid UTF-8, but no
// PostgreSQL text, jsonb included, can hold it) failed the store of the
// response: the first request and every retry with its key got 500 and
// the handler's effect was rolled back each time. It is kept like a value
// that is not UTF-8, and the replay carries what the first response did.
// (Go's HTTP client refuses such a header line, so the middleware is
// called directly.)
func TestStoredHeaderWithANULReplaysAsSent(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Location", "/a\x00b")
		insertEffect(w, r)
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
	call := func() *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader("b"))
		req.Header.Set(idempotency.DefaultHeader, "k")
		rec := httptest.NewRecorder()
		s.mw.Handler(http.HandlerFunc(h)).ServeHTTP(rec, req)
		return rec
	}
	first := call()
	require.Equal(t, http.StatusCreated, first.Code, first.Body.String())
	again := call()
	require.Equal(t, "true", again.Header().Get(idempotency.ReplayedHeader), again.Body.String())
	assert.Equal(t, []string{"/a\x00b"}, again.Header().Values("Content-Location"))
	assert.Equal(t, first.Body.String(), again.Body.String())
	var effects int
	require.NoError(t, s.pool.QueryRow(context.Background(), `SELECT count(*) FROM effects`).Scan(&effects))
	assert.Equal(t, 1, effects)
}

// A handler may set a header under a name that is not in canonical form
// (w.Header()["content-location"], as code ported from HTTP/2 or gRPC
// gateways does); net/http sends it so. The stored headers were looked up
// by canonical name only, so the replay of such a response lacked the
// header the first response had.
func TestStoredHeaderSetUnderANonCanonicalNameReplays(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		w.Header()["content-location"] = []string{"/orders/7"}
		w.Header()["etag"] = []string{`"v1"`}
		w.Header().Set("ETag", `"v2"`) // the same header under both forms: every value is kept
		insertEffect(w, r)
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
	first := s.post("/orders", "k", "b")
	require.Equal(t, http.StatusCreated, first.status, first.body)
	require.Equal(t, "/orders/7", first.header.Get("Content-Location"), "net/http sends it")
	again := s.post("/orders", "k", "b")
	require.True(t, again.replayed())
	assert.Equal(t, "/orders/7", again.header.Get("Content-Location"))
	assert.ElementsMatch(t, first.header.Values("ETag"), again.header.Values("ETag"))
}
