package dedup_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
)

// Tables dropped by hand after Migrate recorded their version (a DBA
// clearing the crash guard's records with DROP TABLE) made every later Migrate, so every
// consumer's start, fail with "does not exist: run Store.Migrate", the
// call that had just failed, and MigrateTo(0) failed too (the down steps
// alter the tables that are gone): no way out but editing
// once_schema_versions by hand. Migrate adopts what is left, as it does
// tables no version was recorded for, and makes the rest again.
func TestMigrateMakesAgainTablesDroppedAfterTheirVersionWasRecorded(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, ddl string
		kept      int // rows of processed_events that outlive the DDL
	}{
		{"attempts dropped", `DROP TABLE processed_events_attempts`, 1},
		{"offsets dropped", `DROP TABLE processed_events_offsets`, 1},
		{"processed events dropped", `DROP TABLE processed_events`, 0},
		{"every table dropped", `DROP TABLE processed_events, processed_events_attempts, processed_events_offsets`, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, pool, s := setup(t)
			claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "before"})
			_, err := pool.Exec(ctx, tc.ddl)
			require.NoError(t, err)

			require.NoError(t, s.Migrate(ctx, pool), "Migrate after %s", tc.ddl)
			v, err := s.Version(ctx, pool)
			require.NoError(t, err)
			assert.Equal(t, dedup.SchemaVersion, v)
			require.NoError(t, s.Check(ctx, pool))
			require.NoError(t, s.CheckOffsets(ctx, pool))
			assert.Equal(t, tc.kept, processed(t, ctx, pool, "c", "before"), "rows of a table left in place are kept")
			assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "after"}).Outcome)
			assert.Equal(t, 1, rowCount(t, ctx, pool, `SELECT count(*) FROM once_schema_versions WHERE component = 'dedup:processed_events' AND version = $1`, dedup.SchemaVersion),
				"the newest version recorded once")
		})
	}
}

// MigrateTo(0) after such a DDL drops what is left, where its down steps
// failed on the table that was gone.
func TestMigrateToZeroAfterATableWasDroppedByHand(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	_, err := pool.Exec(ctx, `DROP TABLE processed_events_attempts`)
	require.NoError(t, err)
	require.NoError(t, s.MigrateTo(ctx, pool, 0))
	assert.Equal(t, 0, rowCount(t, ctx, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename LIKE 'processed_events%'`))
	require.NoError(t, s.Migrate(ctx, pool))
}
