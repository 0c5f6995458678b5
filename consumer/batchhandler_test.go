package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
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

// insertEffects writes a batch with one multi-row statement.
func insertEffects(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
	ids := make([]string, len(evs))
	ns := make([]int32, len(evs))
	for i, ev := range evs {
		ids[i], ns[i] = ev.ID, int32(ev.Payload.N)
	}
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, n) SELECT * FROM unnest($1::text[], $2::int[])`, ids, ns)
	return err
}

func TestBatchHandler(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	const total = 400
	b := memsource.New(memsource.Options{Streams: 2})
	for i := 0; i < total; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
		if i%10 == 0 {
			publish(b, fmt.Sprintf("e%d", i), i)
		}
	}
	var biggest atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
		if n := int32(len(evs)); n > biggest.Load() {
			biggest.Store(n)
		}
		for _, ev := range evs {
			if ev.Payload.N == 123 {
				return errors.New("order 123 is invalid")
			}
		}
		return insertEffects(ctx, tx, evs)
	}
	cfg := fastConfig("batch-handler")
	cfg.Batch.Size = 50
	cfg.Batch.Linger = 10 * time.Millisecond
	c, err := consumer.NewBatch(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == total+total/10 }, 20*time.Second, 5*time.Millisecond)
	got := requireEffectsOnce(t, pool, total-1)
	assert.Zero(t, got["e123"])
	dl := b.DeadLetters()
	require.Len(t, dl, 1)
	assert.Equal(t, "e123", dl[0].Headers[consumer.HeaderEventID])
	assert.Greater(t, biggest.Load(), int32(1), "events arrive in batches")
	assert.Equal(t, uint64(total/10), c.Stats().Duplicates)
}

// TestBatchHandlerErrorIsBisected: a BatchHandler error names no event, so
// the batch is halved until the bad event is alone: a handful of
// transactions instead of one per event, with order kept.
func TestBatchHandlerErrorIsBisected(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	const total, bad = 64, 37
	b := memsource.New(memsource.Options{Streams: 1})
	for i := 0; i < total; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	var calls atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
		calls.Add(1)
		for _, ev := range evs {
			if ev.Payload.N == bad {
				return errors.New("bad event")
			}
		}
		return insertEffects(ctx, tx, evs)
	}
	cfg := fastConfig("bisect")
	cfg.Batch.Size = total
	cfg.Batch.Linger = time.Second // the whole backlog is one batch
	c, err := consumer.NewBatch(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == total }, 20*time.Second, 5*time.Millisecond)

	// 64 -> 32 + 32 -> ... -> the bad event alone, plus its retries: 15
	// calls; one call per event after the first failure would be 67.
	assert.LessOrEqual(t, calls.Load(), int32(15+cfg.Retry.MaxAttempts))
	requireEffectsOnce(t, pool, total-1)
	dl := b.DeadLetters()
	require.Len(t, dl, 1)
	assert.Equal(t, fmt.Sprintf("e%d", bad), dl[0].Headers[consumer.HeaderEventID])

	rows, err := pool.Query(context.Background(), `SELECT n FROM effects ORDER BY seq`)
	require.NoError(t, err)
	order, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	require.NoError(t, err)
	for i := 1; i < len(order); i++ {
		require.Less(t, order[i-1], order[i], "effects committed out of stream order: %v", order)
	}
}

// A BatchHandler's RetryAfter names no event, but it names a wait: a
// dependency that asks the consumer to come back later (a rate limit) is
// not called again before that wait, while the batch is halved to find out
// whether one event is the cause.
func TestBatchHandlerRetryAfterWaitsBeforeTheBatchIsHalved(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	const total, limited = 16, 3
	const wait = 150 * time.Millisecond
	b := memsource.New(memsource.Options{Streams: 1})
	for i := 0; i < total; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	var mu sync.Mutex
	var calls []time.Time
	h := func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
		mu.Lock()
		calls = append(calls, time.Now())
		n := len(calls)
		mu.Unlock()
		if n <= limited {
			return consumer.RetryAfter(wait, errors.New("429: rate limited"))
		}
		return insertEffects(ctx, tx, evs)
	}
	cfg := fastConfig("batch-retry-after")
	cfg.Batch.Size = total
	cfg.Batch.Linger = time.Second // the whole backlog is one batch
	c, err := consumer.NewBatch(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == total }, 20*time.Second, 5*time.Millisecond)
	requireEffectsOnce(t, pool, total)
	mu.Lock()
	defer mu.Unlock()
	require.Greater(t, len(calls), limited)
	for i := 1; i <= limited; i++ {
		assert.GreaterOrEqual(t, calls[i].Sub(calls[i-1]), wait, "call %d came %v after a RetryAfter(%v)", i+1, calls[i].Sub(calls[i-1]), wait)
	}
}

// A BatchHandler's batch run again (halved after a failure) gets each
// payload as its message holds it, not as the rolled-back run left it.
func TestBatchHandlerRunAgainGetsThePayloadAsTheMessageHoldsIt(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := 1; i <= 4; i++ {
		publishKeyed(b, "k", fmt.Sprintf("e%d", i), i)
	}
	var calls atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[*order]) error {
		for _, ev := range evs {
			ev.Payload.N *= 10 // converted in place
		}
		if err := insertEffectsPtr(ctx, tx, evs); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			return errors.New("the first call fails after its writes") // rolled back, halved
		}
		return nil
	}
	cfg := fastConfig("batch-payload-per-run")
	cfg.Batch.Size = 4
	cfg.Batch.Linger = time.Minute // one batch of all four
	c, err := consumer.NewBatch(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	wctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(wctx, 4))
	require.NoError(t, stop())
	rows, err := pool.Query(context.Background(), `SELECT n FROM effects ORDER BY n`)
	require.NoError(t, err)
	ns, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	require.NoError(t, err)
	assert.Equal(t, []int32{10, 20, 30, 40}, ns, "each amount converted once")
}

func insertEffectsPtr(ctx context.Context, tx pgx.Tx, evs []consumer.Event[*order]) error {
	for _, ev := range evs {
		if _, err := tx.Exec(ctx, `INSERT INTO effects (event_id, n) VALUES ($1, $2)`, ev.ID, ev.Payload.N); err != nil {
			return err
		}
	}
	return nil
}

// A BatchHandler that returns with the rows of a query left open fails
// its batch like any error of its own: halved until the event whose run
// leaves them open is alone and dead-lettered (was: the COMMIT failed with
// "conn busy", retried as an infrastructure failure without end).
func TestBatchHandlerRowsLeftOpenAreItsFailure(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := 0; i < 4; i++ {
		publishKeyed(b, "k", fmt.Sprintf("e%d", i), i)
	}
	h := func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
		for _, ev := range evs {
			if ev.ID == "e2" {
				rows, err := tx.Query(ctx, `SELECT generate_series(1, 10)`)
				if err != nil {
					return err
				}
				rows.Next() // the first row only; rows never closed
				return nil
			}
		}
		return insertEffects(ctx, tx, evs)
	}
	cfg := fastConfig("batch-rows-left-open")
	cfg.Batch.Size = 4
	cfg.Batch.Linger = time.Minute // one batch of all four
	c, err := consumer.NewBatch(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	wctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(wctx, 4), "infrastructure failures: %d", c.Stats().InfraErrors)
	require.NoError(t, stop())
	assert.Equal(t, map[string]string{"e2": string(consumer.KindHandler)}, deadLetterKinds(b))
	assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e3": 1}, countEffects(t, pool))
}

// TestBatchHandlerCommitIsRefusedAndChargedToItsEvent: a BatchHandler that
// commits the consumer's transaction when a given event is in its batch is
// refused; the batch is halved until that event is alone and
// dead-lettered with its writes rolled back, and the others are handled
// once.
func TestBatchHandlerCommitIsRefusedAndChargedToItsEvent(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := 0; i < 4; i++ {
		publishKeyed(b, "k", fmt.Sprintf("e%d", i), i)
	}
	h := func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
		if err := insertEffects(ctx, tx, evs); err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.ID == "e2" {
				_ = tx.Commit(ctx) // refused; the error dropped
			}
		}
		return nil
	}
	cfg := fastConfig("batch-commits")
	cfg.Batch.Size = 4
	cfg.Batch.Linger = time.Minute // one batch of all four
	c, err := consumer.NewBatch(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	wctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(wctx, 4), "infrastructure failures: %d", c.Stats().InfraErrors)
	require.NoError(t, stop())
	assert.Equal(t, map[string]string{"e2": string(consumer.KindHandler)}, deadLetterKinds(b))
	assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e3": 1}, countEffects(t, pool))
}

// A BatchHandler that ends its transaction with a COMMIT of its own midway
// loses no event: what it writes after that COMMIT still goes through, and
// every event has its effect once. (Which of its events that COMMIT made
// durable is the handler's to know: none is handled again.)
func TestBatchHandlerEndingItsTransactionLosesNoEvent(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := range 6 {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	h := func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
		for _, ev := range evs {
			if err := insertEffect(ctx, tx, ev); err != nil {
				return err
			}
			if ev.ID == "e2" {
				if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
					return err
				}
			}
		}
		return nil
	}
	cfg := fastConfig("batch-handler-ends-tx")
	cfg.Batch.Linger = time.Second // one batch of all six
	c, err := consumer.NewBatch(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 6 }, 10*time.Second, 5*time.Millisecond)
	requireEffectsOnce(t, pool, 6)
}

// A BatchHandler that ends its transaction with a ROLLBACK of its own
// midway left nothing of its batch durable, its claims included: what it
// then wrote through tx, or queued, went through at once, outside any
// transaction, and the batch ran again for it (halved to find the failing
// event), so those events' effects were written twice; after a ROLLBACK
// AND CHAIN, or ROLLBACK; BEGIN, the consumer committed the transaction the
// handler opened, and acked the events it had rolled back as handled, their
// effects lost. Its statements after the ROLLBACK are refused, as a
// Handler's are, what it queued is not sent, and the transaction is not
// committed: every other event has its effect once, and the event whose
// run ends the transaction is dead-lettered.
func TestBatchHandlerRollingBackItsTransactionDoublesNoEffect(t *testing.T) {
	for _, tc := range []struct {
		rollback string
		// queued: the writes after the ROLLBACK are queued; queuedRollback:
		// the ROLLBACK is too.
		queued, queuedRollback bool
	}{
		{"ROLLBACK", false, false}, {"ROLLBACK", true, false}, {"ROLLBACK", true, true},
		{"ROLLBACK AND CHAIN", false, false}, {"ROLLBACK; BEGIN", false, false},
	} {
		rollback, queued, queuedRollback := tc.rollback, tc.queued, tc.queuedRollback
		t.Run(fmt.Sprintf("%s/queued=%v/queuedRollback=%v", rollback, queued, queuedRollback), func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			for i := range 6 {
				publishKeyed(b, "k", fmt.Sprintf("e%d", i), i)
			}
			h := func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
				rolledBack := false
				for _, ev := range evs {
					if queued && rolledBack {
						ev.Queue(`INSERT INTO effects (event_id, n) VALUES ($1, $2)`, ev.ID, ev.Payload.N)
						continue
					}
					if err := insertEffect(ctx, tx, ev); err != nil {
						return err
					}
					switch {
					case ev.ID == "e2" && queuedRollback:
						ev.Queue(rollback)
						rolledBack = true
					case ev.ID == "e2":
						if _, err := tx.Exec(ctx, rollback); err != nil {
							return err
						}
						rolledBack = true
					}
				}
				return nil
			}
			cfg := fastConfig("batch-handler-rolls-back")
			cfg.Batch.Linger = time.Second // one batch of all six
			c, err := consumer.NewBatch(pool, b.Source(), h, cfg)
			require.NoError(t, err)
			stop := start(t, c)
			wctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			require.NoError(t, b.WaitAcked(wctx, 6))
			require.NoError(t, stop())
			assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e3": 1, "e4": 1, "e5": 1}, countEffects(t, pool),
				"every other event has its effect once")
			assert.Equal(t, map[string]string{"e2": string(consumer.KindHandler)}, deadLetterKinds(b))
		})
	}
}
