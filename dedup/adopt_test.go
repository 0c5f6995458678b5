package dedup_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// Tables made from the plain SQL files (goose, golang-migrate), every
// version applied and none recorded, were adopted as version 1: MigrateTo
// 0 then ran version 1's down alone, dropping the processed-events and
// attempts tables and keeping the offsets table, with the positions of
// Kafka partitions in it, which a store created again later took on.
func TestMigrateToZeroDropsEveryTableOfUnrecordedFiles(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, schema := pgtest.Schema(t)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, s.SchemaSQL())
	require.NoError(t, err)

	require.NoError(t, s.MigrateTo(ctx, pool, 0))
	for _, table := range []string{"processed_events", "processed_events_attempts", "processed_events_offsets"} {
		var exists bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists))
		assert.False(t, exists, table)
	}
	assertVersion(t, ctx, pool, s, schema, 0)
}

// The tables of an unversioned release with the retention index built
// beforehand (CREATE INDEX CONCURRENTLY, as operations.md has it): still
// version 1, so that version 2 drops the old index.
func TestAdoptingTheUnversionedSchemaWithAPrebuiltIndexDropsTheOldOne(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, schema := pgtest.Schema(t)
	_, err := pool.Exec(ctx, unversionedSchema+`
CREATE INDEX processed_events_consumer_processed_at_idx ON processed_events (consumer, processed_at);`)
	require.NoError(t, err)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	assertVersion(t, ctx, pool, s, schema, dedup.SchemaVersion)
	assert.Equal(t, []string{"consumer", "processed_at"}, secondaryIndex(t, ctx, pool, schema, "processed_events"))
}
