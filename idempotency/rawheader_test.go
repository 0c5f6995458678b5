package idempotency_test

import (
	"net/http"
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
