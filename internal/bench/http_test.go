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

// TestCheckHTTPFindsWrongKeys: the right number of business rows is not
// enough; each key must have its own: one per request for plain, one for
// the middleware.
func TestCheckHTTPFindsWrongKeys(t *testing.T) {
	ctx := context.Background()
	db, _ := pgtest.Schema(t)
	const schema = "oncebench_check_http_test"
	require.NoError(t, createSchema(ctx, db, schema))
	defer dropSchema(db, schema)
	// One client, 11 requests: keys c0-0 to c0-8, c0-8 again (its tenth
	// request, a retry), then c0-10.
	sent := []int{11}
	state := func(keys ...string) {
		_, err := db.Exec(ctx, `TRUNCATE oncebench_check_http_test.effects`)
		require.NoError(t, err)
		for _, k := range keys {
			_, err := db.Exec(ctx, `INSERT INTO oncebench_check_http_test.effects VALUES ($1, 0, 'acct', 1)`, k)
			require.NoError(t, err)
		}
	}
	once := []string{"c0-0", "c0-1", "c0-2", "c0-3", "c0-4", "c0-5", "c0-6", "c0-7", "c0-8", "c0-10"}
	for _, tc := range []struct {
		row     Row
		keys    []string
		correct bool
	}{
		{HTTPIdempotency, once, true},
		{HTTPIdempotency, append([]string{"c0-1"}, once[1:]...), false}, // c0-0 lost, c0-1 twice
		{HTTPPlain, append([]string{"c0-8"}, once...), true},
		{HTTPPlain, append([]string{"c0-0"}, once...), false}, // the retry of c0-8 lost, c0-0 twice
	} {
		state(tc.keys...)
		res := &HTTPResult{Row: tc.row, Requests: 11, Keys: 10, sent: sent}
		require.NoError(t, checkHTTP(ctx, db, schema, res))
		assert.Equal(t, tc.correct, res.Correct, "%s %v", tc.row, tc.keys)
	}
}
