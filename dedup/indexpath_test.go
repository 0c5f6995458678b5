package dedup_test

import (
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// With Schema "", the store's tables are found through the search_path, and
// so were the names of their indexes when Migrate checked the retention
// index: an index lives in its table's schema, but the name was looked up
// in the first schema of the path that has one. A store whose retention
// index was dropped on purpose (a store without retention, which Migrate
// accepts) on a path that goes on to another schema with a store of the
// same table name (a service in public, say) was refused at every start:
// "its name is taken by an index of <the other schema>.processed_events",
// though nothing in its own schema holds the name.
func TestRetentionIndexNameIsLookedUpInTheTablesSchema(t *testing.T) {
	ctx := testCtx(t)
	own, ownSchema := pgtest.Schema(t)
	other, otherSchema := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, other), "another service's store, in its schema")
	require.NoError(t, store.Migrate(ctx, own))
	_, err = own.Exec(ctx, `DROP INDEX `+pgx.Identifier{ownSchema, "processed_events_consumer_processed_at_idx"}.Sanitize())
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, own), "an index dropped on purpose is the user's choice")

	// The service's path goes on to the other schema.
	onPath := pgtest.NewPool(t, ownSchema+", "+otherSchema)
	require.NoError(t, store.Migrate(ctx, onPath))
}
