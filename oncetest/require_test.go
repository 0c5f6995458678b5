package oncetest_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/oncetest"
)

// requireEachOnce runs oncetest.RequireEachOnce on a recorder and returns
// its failure message, "" when it passed.
func requireEachOnce(t *testing.T, pool *pgxpool.Pool, query string, want ...string) string {
	t.Helper()
	return oncetest.FatalOf(t, func(tb testing.TB) { oncetest.RequireEachOnce(tb, pool, query, want...) })
}

// Keys are compared as PostgreSQL writes them: a uuid key is its usual
// text, not the bytes of its Go value, and a NULL key is no key at all,
// not even "".
func TestRequireEachOnceComparesKeysAsPostgreSQLWritesThem(t *testing.T) {
	pool := oncetest.Postgres(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE orders (id uuid, n bigint, amount numeric, tag text);
		INSERT INTO orders VALUES ('8c2f3d4e-0000-4000-8000-000000000001', 1, 1.50, 'a'),
			('8c2f3d4e-0000-4000-8000-000000000002', 2, 2.25, NULL)`)
	require.NoError(t, err)

	assert.Empty(t, requireEachOnce(t, pool, `SELECT id FROM orders`,
		"8c2f3d4e-0000-4000-8000-000000000001", "8c2f3d4e-0000-4000-8000-000000000002"), "uuid keys")
	assert.Empty(t, requireEachOnce(t, pool, `SELECT n FROM orders`, "1", "2"), "integer keys")
	assert.Empty(t, requireEachOnce(t, pool, `SELECT amount FROM orders`, "1.50", "2.25"), "numeric keys")

	assert.NotEmpty(t, requireEachOnce(t, pool, `SELECT tag FROM orders`, "a", ""), "a NULL key is not \"\"")
	assert.NotEmpty(t, requireEachOnce(t, pool, `SELECT tag FROM orders`, "a"), "a NULL key is an unexpected row")
	assert.NotEmpty(t, requireEachOnce(t, pool, `SELECT id FROM orders UNION ALL SELECT id FROM orders`,
		"8c2f3d4e-0000-4000-8000-000000000001", "8c2f3d4e-0000-4000-8000-000000000002"), "each key twice")
}

// A key listed twice in want is the test's mistake (each key is wanted
// once), and the failure says so rather than "a" 0 times.
func TestRequireEachOnceSaysWhenAKeyIsWantedTwice(t *testing.T) {
	pool := oncetest.Postgres(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE orders (id text); INSERT INTO orders VALUES ('a')`)
	require.NoError(t, err)
	msg := requireEachOnce(t, pool, `SELECT id FROM orders`, "a", "a")
	assert.Contains(t, msg, `"a" is listed twice in want`)
}

// A nil pool (a setup that failed, a pool not yet made) fails the test
// with a message, not with a nil-pointer panic.
func TestRequireEachOnceFailsOnNilPool(t *testing.T) {
	msg := requireEachOnce(t, nil, `SELECT 1`, "1")
	assert.Contains(t, msg, "nil pool")
}
