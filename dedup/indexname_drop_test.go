package dedup_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// The other order of TestMigrateRefusesARetentionIndexNameTakenByAnotherStore:
// a store "billing" is at the newest version, its retention index named
// billing_consumer_processed_at_idx, and a store "billing_consumer" is then
// created in the same schema. Its version 1 finds that name taken and
// creates no index on processed_at; its version 2 then drops "its" old
// index by name: billing's retention index. Both migrations succeed, and
// billing's next Migrate finds the name free and accepts the table
// without an index: retention of billing reads every row of the consumer
// at each statement, and nothing says so.
func TestMigratingAnotherStoreKeepsTheRetentionIndexWhoseNameItShares(t *testing.T) {
	ctx := testCtx(t)
	pool, schema := pgtest.Schema(t)
	billing, err := dedup.New(dedup.Config{Table: "billing"})
	require.NoError(t, err)
	other, err := dedup.New(dedup.Config{Table: "billing_consumer"})
	require.NoError(t, err)
	require.NoError(t, billing.Migrate(ctx, pool))
	require.Equal(t, []string{"consumer", "processed_at"}, secondaryIndex(t, ctx, pool, schema, "billing"))

	if err := other.Migrate(ctx, pool); err != nil {
		// Refusing is fine too, as long as billing keeps its index.
		t.Logf("the other store's Migrate: %v", err)
	}
	assert.Equal(t, []string{"consumer", "processed_at"}, secondaryIndex(t, ctx, pool, schema, "billing"),
		"billing's retention index, dropped by another store's migration")
	require.NoError(t, billing.Migrate(ctx, pool))
	assert.Equal(t, []string{"consumer", "processed_at"}, secondaryIndex(t, ctx, pool, schema, "billing"))
}
