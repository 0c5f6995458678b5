package consumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// A deploy rolled back: the dedup tables are at a version a newer release
// made. When that release recorded that this one runs on it (every step
// above this release's is additive), the consumer starts, and warns;
// otherwise Run fails with ErrSchemaNewer, changing nothing, as before.
func TestConsumerStartsOnANewerSchemaThatRecordsItCompatible(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	migratedStore(t, pool)
	newer := dedup.SchemaVersion + 1
	_, err := pool.Exec(ctx, `INSERT INTO once_schema_versions (component, version, name, compatible_from)
		VALUES ('dedup:processed_events', $1, 'from_a_newer_release', $2)`, newer, dedup.SchemaVersion)
	require.NoError(t, err)

	logged := startWarnings(t, pool, "rolled-back")
	assert.Contains(t, logged, "newer schema version than this release knows")
	assert.Contains(t, logged, fmt.Sprintf("schema_version=%d", newer))

	_, err = pool.Exec(ctx, `UPDATE once_schema_versions SET compatible_from = $1 WHERE version = $1`, newer)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{Streams: 1})
	c, err := consumer.New(pool, b.Source(), insertEffect, fastConfig("rolled-back"))
	require.NoError(t, err)
	runCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	err = c.Run(runCtx)
	require.ErrorIs(t, err, dedup.ErrSchemaNewer)
	assert.Contains(t, err.Error(), fmt.Sprintf("needs code of version %d or later", newer))
}
