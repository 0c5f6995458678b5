package idempotency_test

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
)

// A scope of any length or content (a client certificate's subject, a long
// token claim, bytes that are not UTF-8) holds keys like any other: the
// claim, the replay and the separation from other scopes work, where the
// scope's text once went into the table's primary key as it was and every
// request of a scope beyond PostgreSQL's index row limit got 500.
func TestAnyScopeHoldsKeys(t *testing.T) {
	random := make([]byte, 4000)
	_, err := rand.Read(random)
	require.NoError(t, err)
	long := hex.EncodeToString(random) // 8000 bytes that do not compress
	sum := sha256.Sum256([]byte(long))
	scopes := map[string]string{
		"long":      long,
		"long too":  long[:len(long)-1] + "x",
		"not utf-8": "caf\xe9",
		"nul":       "a\x00b",
		"edge":      long[:2048],
		// What a long scope is stored as, sent as a scope: another client.
		"posing": "once:sha256:" + hex.EncodeToString(sum[:]),
	}
	scope := func(r *http.Request) string { return scopes[r.Header.Get("X-Client")] }
	s := newService(t, idempotency.Config{Scope: scope}, http.HandlerFunc(insertEffect))
	bodies := map[string]string{}
	for client := range scopes {
		r := s.post("/orders", "k", "b", "X-Client", client)
		assert.Equal(t, http.StatusCreated, r.status, "%s: %s", client, r.body)
		bodies[client] = r.body
	}
	for client := range scopes {
		r := s.post("/orders", "k", "b", "X-Client", client)
		assert.True(t, r.replayed(), client)
		assert.Equal(t, bodies[client], r.body, client)
	}
	assert.Equal(t, len(scopes), s.effects())

	// The longest scope stored as it is, with the longest key.
	longKey := strings.Repeat("k", idempotency.MaxKeyLength)
	r := s.post("/orders", longKey, "b", "X-Client", "edge")
	require.Equal(t, http.StatusCreated, r.status, r.body)
	assert.True(t, s.post("/orders", longKey, "b", "X-Client", "edge").replayed())
	assert.Equal(t, 1, count(t, s.pool, `SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND idempotency_key = $2`,
		long[:2048], longKey), "stored as it is")
}
