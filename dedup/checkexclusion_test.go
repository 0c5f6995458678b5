package dedup_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
)

// An exclusion constraint is an arbiter of the claims' ON CONFLICT, which
// names no target, as a unique index is: one that takes two distinct ids
// (or the same id of two consumers sharing the table) for one made the
// claim of an id never claimed do nothing, and its lookup found no row on
// every try, "no rows in result set", an error with no SQLSTATE that reads
// as an outage: the stream stood still. Check refused the same key as a
// unique index but passed it as an exclusion constraint; it refuses both.
func TestCheckRefusesAnExclusionConstraintThatTakesDistinctIDsForOne(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, ddl, diff string }{{
		name: "one claim per position",
		ddl:  `ALTER TABLE processed_events ADD CONSTRAINT one_per_position EXCLUDE USING btree (source WITH =, partition WITH =, "offset" WITH =)`,
		diff: "exclusion constraint one_per_position",
	}, {
		name: "event_id across consumers",
		ddl:  `ALTER TABLE processed_events ADD CONSTRAINT id_any_consumer EXCLUDE USING btree (event_id WITH =)`,
		diff: "exclusion constraint id_any_consumer",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, pool, s := setup(t)
			_, err := pool.Exec(ctx, tc.ddl)
			require.NoError(t, err)
			for what, err := range map[string]error{"Check": s.Check(ctx, pool), "Migrate": s.Migrate(ctx, pool)} {
				require.ErrorIs(t, err, dedup.ErrSchemaMismatch, what)
				assert.Contains(t, err.Error(), tc.diff, what)
			}
		})
	}

	// What such a constraint does: the claim of a new id fails on every
	// try, with an error that is no schema mismatch.
	ctx, pool, s := setup(t)
	_, err := pool.Exec(ctx, `ALTER TABLE processed_events ADD CONSTRAINT id_any_consumer EXCLUDE USING btree (event_id WITH =)`)
	require.NoError(t, err)
	require.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "billing", EventID: "evt-1"}).Outcome)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	_, err = s.Claim(ctx, tx, dedup.Claim{Consumer: "shipping", EventID: "evt-1"})
	require.ErrorContains(t, err, "no rows", "shipping never claimed evt-1")

	// One that reads a column the store does not write is left alone.
	ctx, pool, s = setup(t)
	_, err = pool.Exec(ctx, `ALTER TABLE processed_events ADD COLUMN tenant bigint;
ALTER TABLE processed_events ADD CONSTRAINT one_per_tenant_position EXCLUDE USING btree (tenant WITH =, source WITH =, partition WITH =, "offset" WITH =)`)
	require.NoError(t, err)
	require.NoError(t, s.Check(ctx, pool))
}
