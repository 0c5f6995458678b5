package bench

import (
	"bytes"
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// The HTTP rows with a few requests: plain runs every retry again, the
// middleware once per key, and both are reported correct.
func TestHTTPRowsSmoke(t *testing.T) {
	db, err := pgxpool.New(context.Background(), pgtest.URL())
	require.NoError(t, err)
	defer db.Close()
	rep, err := runHTTP(context.Background(), db, Options{DatabaseURL: pgtest.URL(), HTTPRequests: 400})
	require.NoError(t, err)
	require.Len(t, rep.Rows, 2)
	plain, idem := rep.Rows[0], rep.Rows[1]
	assert.Equal(t, 400, plain.Effects, "plain: a retry runs again")
	assert.Greater(t, plain.Effects, plain.Keys)
	assert.Equal(t, idem.Keys, idem.Effects, "the middleware: one effect per key")
	assert.Less(t, idem.Effects, idem.Requests)
	assert.True(t, rep.Correct())
	var out bytes.Buffer
	require.NoError(t, (&Report{HTTP: rep}).HTTP.writeTable(&out))
	assert.Contains(t, out.String(), "http idempotency")
}
