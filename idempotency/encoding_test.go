package idempotency_test

import (
	"bytes"
	"compress/gzip"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
)

// A compressed response replays with its Content-Encoding: without it, the
// stored body is bytes the client cannot read.
func TestCompressedResponseReplaysDecodable(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		var buf bytes.Buffer
		zw := gzip.NewWriter(&buf)
		_, _ = zw.Write([]byte(`{"id":1}`))
		_ = zw.Close()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "gzip")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(buf.Bytes())
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
	first := s.post("/orders", "k", "b") // net/http's client asks for gzip and decodes it
	require.Equal(t, http.StatusCreated, first.status)
	require.Equal(t, `{"id":1}`, first.body)
	again := s.post("/orders", "k", "b")
	assert.True(t, again.replayed())
	assert.Equal(t, first.body, again.body)
}
