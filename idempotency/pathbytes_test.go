package idempotency_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
)

// A path whose escapes decode to bytes a text column cannot hold (a NUL,
// a byte that is not UTF-8, such as a Latin-1 file name) is a path like
// any other: the request runs once and its retry is a replay, rather than
// every try failing with 500 on the claim.
func TestPathBytesTextCannotHoldAreStored(t *testing.T) {
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	for i, path := range []string{"/files/caf%E9", "/files/a%00b"} {
		key := []string{"k1", "k2"}[i]
		first := s.post(path, key, "b")
		require.Equal(t, http.StatusCreated, first.status, "%s: %s", path, first.body)
		again := s.post(path, key, "b")
		assert.True(t, again.replayed(), path)
		assert.Equal(t, first.body, again.body, path)
	}
	assert.Equal(t, 2, s.effects())
	var stored []string
	rows, err := s.pool.Query(context.Background(), `SELECT path FROM idempotency_keys ORDER BY idempotency_key`)
	require.NoError(t, err)
	for rows.Next() {
		var p string
		require.NoError(t, rows.Scan(&p))
		stored = append(stored, p)
	}
	require.NoError(t, rows.Err())
	assert.Equal(t, []string{"/files/caf%E9", "/files/a%00b"}, stored, "stored as the request sent it")
}
