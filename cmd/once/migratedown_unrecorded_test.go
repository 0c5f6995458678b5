package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// Tables made by golang-migrate or goose from dedup/migrations (every
// version, none recorded in once_schema_versions). migrate down -to 0 says
// "its tables dropped"; the offsets table, with a Kafka partition's
// position in it, must go with the others.
func TestMigrateDownToZeroDropsUnrecordedTables(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, store.SchemaSQL())
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO processed_events_offsets (consumer, topic, partition, next_offset) VALUES ('billing', 'orders', 0, 42)`)
	require.NoError(t, err)
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}

	code, out, errOut := cli(t, env, "migrate", "down", "-to", "0")
	require.Equal(t, exitOK, code, errOut)
	t.Log(out)
	for _, table := range []string{"processed_events", "processed_events_attempts", "processed_events_offsets"} {
		var exists bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists))
		assert.False(t, exists, "%s after migrate down -to 0, which said %q", table, out)
	}
}
