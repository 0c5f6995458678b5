package consumer_test

import (
	"context"
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

// An event's queued statements are sent by the next statement a later
// handler of the batch sends through tx. They were sent under that
// handler's context: its HandlerTimeout, or a deadline it put on its own
// statement, cut the earlier event's statements, and the cut was charged
// to that event, though HandlerTimeout does not bound sending queued
// statements (run alone, they are sent after the handler, unbounded):
// with Retry.MaxAttempts 1, a good event was dead-lettered. They are now
// sent outside any deadline or cancel of the handler running then.
func TestQueuedStatementsAreNotCutByALaterHandlersDeadline(t *testing.T) {
	t.Run("HandlerTimeout", func(t *testing.T) {
		queuedNotCutByLaterHandler(t, laterBound, func(ctx context.Context) (context.Context, context.CancelFunc) {
			return ctx, func() {}
		})
	})
	t.Run("own deadline", func(t *testing.T) {
		queuedNotCutByLaterHandler(t, consumer.NoHandlerTimeout, func(ctx context.Context) (context.Context, context.CancelFunc) {
			return context.WithTimeout(ctx, laterBound)
		})
	})
}

// laterBound is the second handler's bound, shorter than the first's queued
// statement (slowQueued), which it cuts when they share a batch; alone, the
// second's own insert must answer within it (with Retry.MaxAttempts 1 a
// cut dead-letters it): 300 ms left a loaded machine too little.
const laterBound = time.Second

// slowQueued is the first handler's slow queued statement: twice
// laterBound, so that the bound always cuts it however late it starts.
const slowQueued = `SELECT pg_sleep(2)`

// queuedNotCutByLaterHandler runs a batch of two events: the first queues
// a statement slower than the second's bound (handlerTimeout, or the
// deadline stmtCtx puts on the second's own statement), and both must
// have their effect, with no retry and no dead letter.
func queuedNotCutByLaterHandler(t *testing.T, handlerTimeout time.Duration, stmtCtx func(context.Context) (context.Context, context.CancelFunc)) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "slow", 0)
	publish(b, "next", 1)
	var slowRuns atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "slow" {
			slowRuns.Add(1)
			ev.Queue(slowQueued)
			ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N)
			return nil
		}
		sctx, cancel := stmtCtx(ctx)
		defer cancel()
		_, err := tx.Exec(sctx, insertEffectSQL, ev.ID, ev.Payload.N)
		return err
	}
	cfg := fastConfig("queued-later-deadline")
	cfg.Retry.MaxAttempts = 1
	cfg.HandlerTimeout = handlerTimeout
	cfg.Batch = consumer.BatchConfig{Size: 2, Linger: 10 * time.Second} // the two in one batch first
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 2 }, 20*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())

	assert.GreaterOrEqual(t, slowRuns.Load(), int32(2), "slow ran in a batch with next, then alone")
	assert.Empty(t, b.DeadLetters())
	assert.Equal(t, map[string]int{"slow": 1, "next": 1}, countEffects(t, pool))
	assert.Zero(t, c.Stats().Retries)
}
