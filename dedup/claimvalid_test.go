package dedup_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
)

// A claim no retry can store is refused before any statement, with
// ErrInvalidClaim, which a caller can tell from an outage: an empty
// EventID was claimed, and every later event without an id was then a
// duplicate of the first, skipped; an id, consumer or source that
// PostgreSQL's text refuses (NUL, not UTF-8) failed with a database error,
// which the caller retried as infrastructure, without end. The
// transaction stays usable.
func TestClaimRefusesWhatPostgreSQLCannotStore(t *testing.T) {
	ctx, pool, s := setup(t)
	good := dedup.Claim{Consumer: "billing", EventID: "evt-1", Source: "orders", Partition: -1, Offset: -1}
	bad := map[string]func(c *dedup.Claim){
		"empty id":            func(c *dedup.Claim) { c.EventID = "" },
		"empty consumer":      func(c *dedup.Claim) { c.Consumer = "" },
		"NUL in the id":       func(c *dedup.Claim) { c.EventID = "evt\x00-1" },
		"id not UTF-8":        func(c *dedup.Claim) { c.EventID = "evt-\xff" },
		"NUL in the consumer": func(c *dedup.Claim) { c.Consumer = "bill\x00ing" },
		"consumer not UTF-8":  func(c *dedup.Claim) { c.Consumer = "billing\xfe" },
		"NUL in the source":   func(c *dedup.Claim) { c.Source = "ord\x00ers" },
		"source not UTF-8":    func(c *dedup.Claim) { c.Source = "orders\xc3" },
	}
	for name, spoil := range bad {
		t.Run(name, func(t *testing.T) {
			c := good
			spoil(&c)
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck
			{
				_, err := s.Claim(ctx, tx, c)
				assert.ErrorIs(t, err, dedup.ErrInvalidClaim, "Claim")
				_, err = s.ClaimBatch(ctx, tx, []dedup.Claim{c})
				assert.ErrorIs(t, err, dedup.ErrInvalidClaim, "ClaimBatch")
				if c.Consumer != "" {
					second := good
					second.Consumer, second.EventID = c.Consumer, "evt-2"
					_, err = s.ClaimBatch(ctx, tx, []dedup.Claim{second, c})
					assert.ErrorIs(t, err, dedup.ErrInvalidClaim, "ClaimBatch, second claim")
				}
				_, err = s.QueueClaimBatch(&pgx.Batch{}, []dedup.Claim{c})
				assert.ErrorIs(t, err, dedup.ErrInvalidClaim, "QueueClaimBatch")
				b := &pgx.Batch{}
				pending := s.QueueClaim(b, c)
				assert.Zero(t, b.Len(), "QueueClaim queued the statement")
				_, err = pending.Result(ctx, tx)
				assert.ErrorIs(t, err, dedup.ErrInvalidClaim, "QueueClaim")
				// Nothing was sent: the transaction goes on.
				res, err := s.Claim(ctx, tx, good)
				require.NoError(t, err)
				assert.Equal(t, dedup.Claimed, res.Outcome)
			}
		})
	}
	assert.Zero(t, processed(t, ctx, pool, "billing", ""), "no row for an empty id")
}

// DeleteOlderThan refuses a consumer name PostgreSQL's text cannot hold
// (NUL, not UTF-8) before any statement, as it refuses an empty one: sent,
// it failed with SQLSTATE 22021, an error that reads as an outage, and
// aborted the transaction of a caller sweeping inside one.
func TestRetentionRefusesAConsumerPostgreSQLCannotStore(t *testing.T) {
	ctx, pool, s := setup(t)
	for name, consumer := range map[string]string{"NUL": "bill\x00ing", "not UTF-8": "billing\xfe"} {
		t.Run(name, func(t *testing.T) {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck
			_, err = s.DeleteOlderThan(ctx, tx, consumer, time.Now(), 10)
			require.Error(t, err)
			assert.Contains(t, err.Error(), "consumer name")
			var one int
			require.NoError(t, tx.QueryRow(ctx, "SELECT 1").Scan(&one), "the transaction goes on")
		})
	}
}

// The Result returned with an error never reads as Claimed: a caller that
// looked at Outcome before the error (or logged it) took a claim that
// failed, or was never sent, for a new id, and ran the handler.
func TestFailedClaimIsNotClaimed(t *testing.T) {
	ctx, pool, s := setup(t)
	var zero dedup.Result
	assert.NotEqual(t, dedup.Claimed, zero.Outcome, "the zero Result")
	assert.NotEqual(t, "claimed", zero.Outcome.String(), "the zero Outcome's name")

	invalid := dedup.Claim{Consumer: "billing", EventID: ""}
	res, err := s.Claim(ctx, pool, invalid)
	require.ErrorIs(t, err, dedup.ErrInvalidClaim)
	assert.NotEqual(t, dedup.Claimed, res.Outcome, "Claim of an invalid claim")

	res, err = s.QueueClaim(&pgx.Batch{}, invalid).Result(ctx, pool)
	require.ErrorIs(t, err, dedup.ErrInvalidClaim)
	assert.NotEqual(t, dedup.Claimed, res.Outcome, "Result of an invalid claim")

	// A statement queued before the claim fails: the claim's result is
	// never read.
	b := &pgx.Batch{}
	b.Queue("SELECT 1/0")
	pending := s.QueueClaim(b, dedup.Claim{Consumer: "billing", EventID: "evt-1"})
	require.Error(t, pool.SendBatch(ctx, b).Close())
	res, err = pending.Result(ctx, pool)
	require.Error(t, err)
	assert.NotEqual(t, dedup.Claimed, res.Outcome, "Result of a claim never read")
	assert.Zero(t, processed(t, ctx, pool, "billing", "evt-1"))
}
