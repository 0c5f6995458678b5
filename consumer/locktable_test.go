package consumer_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// A transaction's locks (on relations, advisory locks) are held until it
// ends, in PostgreSQL's shared lock table, which holds about
// max_locks_per_transaction × max_connections of them: past that, the
// statement that asks for one more fails with "out of shared memory"
// (53200, with a hint to raise max_locks_per_transaction). A batch
// holds the locks of all its handlers at once, so a batch whose messages
// each fit the table alone (a handler that locks its tenant's tables, or
// an advisory lock per account) may overflow it together. The failure is
// infrastructure, rightly charged to no message, but the same batch was
// tried again as it was, without end: its stream stood still. It is
// halved instead, as for a transaction that ran out of time, until its
// runs fit.
func TestLockTableOverflowedByABatchIsHalvedNotRetriedForEver(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	ctx := context.Background()
	var slots int
	require.NoError(t, pool.QueryRow(ctx, `SELECT current_setting('max_locks_per_transaction')::int *
		(current_setting('max_connections')::int + current_setting('max_prepared_transactions')::int)`).Scan(&slots))
	const messages = 16
	perMessage := 4 * slots / messages // the batch needs four times the table; each message a quarter of it
	b := memsource.New(memsource.Options{Streams: 1})
	want := map[string]int{}
	for i := range messages {
		publish(b, fmt.Sprintf("e%d", i), i)
		want[fmt.Sprintf("e%d", i)] = 1
	}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		first := int64(ev.Payload.N * perMessage)
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(k) FROM generate_series($1::bigint, $2::bigint) k`,
			first, first+int64(perMessage)-1); err != nil {
			return err
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("lock-table")
	cfg.Retry.MaxAttempts = 1
	cfg.Batch.Linger = time.Second // one batch of all of them
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == messages }, 20*time.Second, 5*time.Millisecond,
		"the batch overflows the lock table every time it is tried as it is")
	assert.Empty(t, deadLetterKinds(b), "no message is charged")
	assert.Equal(t, want, countEffects(t, pool))
}

// TestLockTableOverflowedByOneMessageIsChargedNotRetriedForEver: a
// message whose handler alone asks for more locks than the server's
// shared lock table holds fails with 53200 on every run, as PostgreSQL's
// hint (raise max_locks_per_transaction) says: it is the handler's, not a
// passing shortage. Met once alone, 53200 is infrastructure (the table is
// shared: other sessions may have filled it for a while); met again in a
// row, it is charged to the message, whose retries then end in the
// dead-letter queue with the SQLSTATE. (It was retried as infrastructure
// without end: its stream stood still, with no way out.)
func TestLockTableOverflowedByOneMessageIsChargedNotRetriedForEver(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	ctx := context.Background()
	var slots int
	require.NoError(t, pool.QueryRow(ctx, `SELECT current_setting('max_locks_per_transaction')::int *
		(current_setting('max_connections')::int + current_setting('max_prepared_transactions')::int)`).Scan(&slots))
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "greedy", 0)
	publish(b, "after", 1)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "greedy" {
			// Twice the table: no run of it ever fits.
			if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(k) FROM generate_series(1, $1::bigint) k`,
				int64(2*slots)); err != nil {
				return err
			}
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("lock-table-alone")
	cfg.Retry.MaxAttempts = 2
	cfg.Batch.Size = 1
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	require.NoError(t, b.WaitEachAcked(waitCtx, 2), "the message is retried as infrastructure for ever; its stream stands still")
	assert.Equal(t, map[string]string{"greedy": string(consumer.KindHandler)}, deadLetterKinds(b))
	assert.Equal(t, "53200", deadLetterOf(t, b, "greedy").Headers[consumer.HeaderErrorSQLState])
	assert.Equal(t, map[string]int{"after": 1}, countEffects(t, pool))
}

// A 53200 that is not the lock table (the server out of memory for a
// while: "out of memory", no hint about max_locks_per_transaction) is the
// server's failure however often a message meets it: it is retried as
// infrastructure, never charged to the message, and the message is handled
// once the server has memory again. Only a full lock table, which the
// message's own locks may overflow on every run, is charged (above).
func TestServerOutOfMemoryIsNotChargedToTheMessage(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	ctx := context.Background()
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "unlucky", 0)
	var runs atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if runs.Add(1) <= 3 {
			// PostgreSQL's own error, as palloc raises it when the
			// server's memory runs out.
			_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '53200', MESSAGE = 'out of memory',
				DETAIL = 'Failed on request of size 8192 in memory context "ExecutorState".'; END $$`)
			return err
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("server-out-of-memory")
	cfg.Retry.MaxAttempts = 1
	cfg.Batch.Size = 1
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	require.NoError(t, b.WaitEachAcked(waitCtx, 1))
	assert.Empty(t, deadLetterKinds(b), "a server out of memory is not the message's failure")
	assert.Equal(t, map[string]int{"unlucky": 1}, countEffects(t, pool))
	assert.EqualValues(t, 4, runs.Load())
}
