package dedup_test

import (
	"crypto/rand"
	"encoding/hex"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
)

// randomText is n bytes of hex text that pglz cannot compress, so that it
// reaches the btree index at its full size.
func randomText(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, (n+1)/2)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return hex.EncodeToString(b)[:n]
}

// A consumer and id too long together for the btree index of the
// (consumer, event_id) key were sent: PostgreSQL refused them on every try
// with SQLSTATE 54000 (index row size exceeds the maximum), which a caller
// cannot tell from an outage, and the transaction was aborted. Such a
// claim is one no retry can store: refused with ErrInvalidClaim before any
// statement. A key of the longest length accepted is stored.
func TestClaimRefusesAKeyTooLongForTheIndex(t *testing.T) {
	ctx, pool, s := setup(t)
	const consumer = "billing"
	good := dedup.Claim{Consumer: consumer, EventID: "evt-1", Partition: -1, Offset: -1}
	for name, c := range map[string]dedup.Claim{
		"long id":       {Consumer: consumer, EventID: randomText(t, 3000)},
		"long consumer": {Consumer: randomText(t, 3000), EventID: "evt-2"},
		"both":          {Consumer: randomText(t, 1500), EventID: randomText(t, 1500)},
	} {
		t.Run(name, func(t *testing.T) {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck
			_, err = s.Claim(ctx, tx, c)
			assert.ErrorIs(t, err, dedup.ErrInvalidClaim, "Claim")
			_, err = s.ClaimBatch(ctx, tx, []dedup.Claim{c})
			assert.ErrorIs(t, err, dedup.ErrInvalidClaim, "ClaimBatch")
			_, err = s.QueueClaimBatch(&pgx.Batch{}, []dedup.Claim{c})
			assert.ErrorIs(t, err, dedup.ErrInvalidClaim, "QueueClaimBatch")
			b := &pgx.Batch{}
			_, err = s.QueueClaim(b, c).Result(ctx, tx)
			assert.ErrorIs(t, err, dedup.ErrInvalidClaim, "QueueClaim")
			assert.Zero(t, b.Len(), "QueueClaim queued the statement")
			// Nothing was sent: the transaction goes on.
			res, err := s.Claim(ctx, tx, good)
			require.NoError(t, err)
			assert.Equal(t, dedup.Claimed, res.Outcome)
		})
	}
	// The longest key accepted, incompressible, with a consumer name long
	// enough for the index's 4-byte length headers.
	longConsumer := strings.Repeat("c", 200)
	longest := dedup.Claim{Consumer: longConsumer, EventID: randomText(t, 2600-len(longConsumer)), Partition: -1, Offset: -1}
	assert.Equal(t, dedup.Claimed, claimTx(t, ctx, pool, s, longest).Outcome)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	batch := []dedup.Claim{longest, {Consumer: longConsumer, EventID: randomText(t, 2600-len(longConsumer))}}
	results, err := s.ClaimBatch(ctx, tx, batch)
	require.NoError(t, err)
	assert.Equal(t, []dedup.Outcome{dedup.Duplicate, dedup.Claimed}, outcomes(results))
}
