package dedup_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
)

// sweepWatched runs DeleteOlderThan on a connection of its own, bounded by
// limit, and reports whether it ever waited on a lock another session held
// (pg_blocking_pids), besides what it returned and how long it took.
func sweepWatched(t *testing.T, ctx context.Context, pool *pgxpool.Pool, s *dedup.Store, consumer string,
	cutoff time.Time, limit time.Duration) (blocked bool, took time.Duration, err error) {
	t.Helper()
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	pid := int32(conn.Conn().PgConn().PID())

	var waited atomic.Bool
	watchCtx, stopWatch := context.WithCancel(ctx)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for watchCtx.Err() == nil {
			var n int
			if pool.QueryRow(watchCtx, `SELECT cardinality(pg_blocking_pids($1))`, pid).Scan(&n) == nil && n > 0 {
				waited.Store(true)
			}
		}
	}()

	sweepCtx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	start := time.Now()
	_, err = s.DeleteOlderThan(sweepCtx, conn, consumer, cutoff, 10)
	took = time.Since(start)
	stopWatch()
	<-watched
	return waited.Load(), took, err
}

// A crash-guard record the consumer deletes inside a handler's transaction
// (with the message's effects) stays locked until that transaction ends,
// which may be as long as the handler's timeout. The sweep of old records
// passes over it instead of waiting, deletes the others, and deletes it at
// a later sweep if the handler's transaction rolled back.
func TestRetentionSkipsAttemptsLockedByAnOpenTransaction(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	a := s.AttemptsTable()
	_, err := pool.Exec(ctx, `INSERT INTO `+a+` (consumer, event_id, attempts, crashes, last_seen)
		SELECT 'c', id, 1, 1, now() - interval '2 days' FROM unnest(ARRAY['held', 'free1', 'free2']) AS u(id)`)
	require.NoError(t, err)

	// What the consumer does in the handler's transaction when the
	// message has a record: delete it, to go when the effects commit.
	handler, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer handler.Rollback(ctx) //nolint:errcheck
	_, err = handler.Exec(ctx, `DELETE FROM `+a+` WHERE consumer = $1 AND event_id = ANY($2::text[])`, "c", []string{"held"})
	require.NoError(t, err)

	cutoff := time.Now().Add(-24 * time.Hour)
	blocked, took, err := sweepWatched(t, ctx, pool, s, "c", cutoff, 3*time.Second)
	assert.NoError(t, err, "the sweep waited %v for the handler's transaction", took)
	assert.False(t, blocked, "the sweep waited on the row the handler's transaction holds")
	ids := func() []string {
		rows, err := pool.Query(ctx, `SELECT event_id FROM `+a+` WHERE consumer = 'c' ORDER BY event_id`)
		require.NoError(t, err)
		var ids []string
		for rows.Next() {
			var id string
			require.NoError(t, rows.Scan(&id))
			ids = append(ids, id)
		}
		require.NoError(t, rows.Err())
		return ids
	}
	assert.Equal(t, []string{"held"}, ids(), "the free records go; the held one is left")

	// The handler failed: its record stays, old, for the next sweep.
	require.NoError(t, handler.Rollback(ctx))
	blocked, _, err = sweepWatched(t, ctx, pool, s, "c", cutoff, 3*time.Second)
	require.NoError(t, err)
	assert.False(t, blocked)
	assert.Empty(t, ids(), "the record skipped before goes at the next sweep")
}

// The sweep of processed events does not wait on a handler's open
// transaction either: the transaction's claims are rows the sweep cannot
// see (new ones, uncommitted) or rows it found already there and did not
// lock (ON CONFLICT DO NOTHING takes no lock on the existing row).
func TestRetentionDoesNotWaitOnOpenClaims(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	_, err := pool.Exec(ctx, `INSERT INTO processed_events (consumer, event_id, processed_at)
		SELECT 'c', id, now() - interval '2 days' FROM unnest(ARRAY['old1', 'old2']) AS u(id)`)
	require.NoError(t, err)

	handler, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer handler.Rollback(ctx) //nolint:errcheck
	res, err := s.ClaimBatch(ctx, handler, []dedup.Claim{
		{Consumer: "c", EventID: "old1", Partition: -1, Offset: -1},
		{Consumer: "c", EventID: "new", Partition: -1, Offset: -1},
	})
	require.NoError(t, err)
	require.Equal(t, dedup.Duplicate, res[0].Outcome)
	require.Equal(t, dedup.Claimed, res[1].Outcome)

	blocked, took, err := sweepWatched(t, ctx, pool, s, "c", time.Now().Add(-24*time.Hour), 3*time.Second)
	require.NoError(t, err, "the sweep waited %v for the handler's transaction", took)
	assert.False(t, blocked, "the sweep waited on a row the handler's transaction holds")
	assert.Equal(t, 0, processed(t, ctx, pool, "c", "old1"))
	assert.Equal(t, 0, processed(t, ctx, pool, "c", "old2"))
	require.NoError(t, handler.Commit(ctx))
	assert.Equal(t, 1, processed(t, ctx, pool, "c", "new"))
}
