package idempotency_test

import (
	"context"
	"io/fs"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
)

// Migrate is idempotent and safe from many processes at once; it creates
// the table in the schema it is given, whatever the search_path.
func TestMigrateIsIdempotentAndConcurrent(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	other, _ := pgtest.Schema(t) // the connections' search_path points elsewhere
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() { errs[i] = idempotency.Migrate(ctx, other, schema) })
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, idempotency.Migrate(ctx, other, schema))
	assert.Equal(t, 1, count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'idempotency_keys'`, schema))
	assert.Equal(t, 1, count(t, pool, `SELECT count(*) FROM once_schema_versions WHERE component = 'idempotency:idempotency_keys'`),
		"version 1 recorded once")
	assert.Equal(t, 0, count(t, other, `SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename = 'idempotency_keys'`))
}

// The numbered files are what migration tools expect: each up file has its
// down file, and down then up leaves a working table.
func TestMigrationFilesGoDownAndUp(t *testing.T) {
	ups, err := fs.Glob(idempotency.Migrations, "*.up.sql")
	require.NoError(t, err)
	require.NotEmpty(t, ups)
	pool, schema := pgtest.Schema(t)
	ctx := context.Background()
	require.NoError(t, idempotency.Migrate(ctx, pool, schema))
	for i := len(ups) - 1; i >= 0; i-- {
		down, err := fs.ReadFile(idempotency.Migrations, ups[i][:len(ups[i])-len(".up.sql")]+".down.sql")
		require.NoError(t, err, "%s has no down file", ups[i])
		_, err = pool.Exec(ctx, string(down))
		require.NoError(t, err)
	}
	assert.Equal(t, 0, count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename <> 'once_schema_versions'`, schema))
	for _, up := range ups { // as a migration tool would run them
		sql, err := fs.ReadFile(idempotency.Migrations, up)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, string(sql))
		require.NoError(t, err)
	}
	require.NoError(t, idempotency.Migrate(ctx, pool, schema), "Migrate after a tool's run")
	assert.Equal(t, 1, count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'idempotency_keys'`, schema))
}

// Services that share a database each keep their tables in a schema of
// their own, first on their search_path, with a common schema after it:
// the schema given to Migrate is "". The schema version is recorded beside
// the table, so each service's table is created, whatever the common
// schema holds: the version table that another component created there was
// taken for the store's, the first service's version recorded in it, and
// the second service, finding its table recorded, created none (every
// request with a key then failed).
func TestMigrateRecordsVersionsBesideTheTableOnTheSearchPath(t *testing.T) {
	ctx := context.Background()
	common, pub := pgtest.Schema(t)
	_, a := pgtest.Schema(t)
	_, b := pgtest.Schema(t)
	// Another component's versions in the common schema.
	require.NoError(t, outbox.Migrate(ctx, common))

	for _, svc := range []string{a, b} {
		pool := pgtest.NewPool(t, svc+", "+pub)
		require.NoError(t, idempotency.Migrate(ctx, pool, ""), svc)
		assert.Equal(t, 1, count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'idempotency_keys'`, svc),
			"the table is in %s", svc)
		assert.Equal(t, 1, count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'once_schema_versions'`, svc),
			"versions are recorded beside %s's table", svc)
	}
}
