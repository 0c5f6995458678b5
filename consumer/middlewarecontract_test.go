package consumer_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// A middleware that runs the handler again after it failed (a retry
// middleware) calls next twice in one transaction: the second call is
// refused with ErrNextCalledTwice, so that the writes of the failed run,
// still in the transaction, are not committed beside those of the next;
// the message is retried in a new transaction, as any failure is, and has
// its effect once. The handler's first run once stayed in the committed
// transaction next to its second: two effects.
func TestMiddlewareCallingNextTwiceRunsTheHandlerOnce(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e1", 1)
	var secondErr error
	cfg := fastConfig("next-twice")
	cfg.Hooks.Middleware = []consumer.Middleware{
		func(ctx context.Context, tx pgx.Tx, info consumer.HandlerInfo, next func(context.Context, pgx.Tx) error) error {
			if err := next(ctx, tx); err != nil {
				secondErr = next(ctx, tx)
				return secondErr
			}
			return nil
		},
	}
	runs := 0
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		runs++
		if err := insertEffect(ctx, tx, ev); err != nil {
			return err
		}
		if runs == 1 {
			return errors.New("failed after its write")
		}
		return nil
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, 1))
	require.NoError(t, stop())
	assert.Equal(t, map[string]int{"e1": 1}, countEffects(t, pool))
	assert.ErrorIs(t, secondErr, consumer.ErrNextCalledTwice)
	assert.Empty(t, b.DeadLetters())
}

// A middleware that returns nil without calling next (one that filters
// events out, say, by tenant) ran no handler: the event is recorded as
// processed and acked like an unknown type under SkipUnknownTypes, and
// reported as skipped, not handled. It was counted in Stats.Handled,
// reported ResultHandled with one run, and passed to AfterCommit, whose
// events are those whose handler ran.
func TestMiddlewareThatDoesNotCallNextSkipsTheEvent(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "filtered", 1)
	publish(b, "kept", 2)
	cfg := fastConfig("next-not-called")
	cfg.Hooks.Middleware = []consumer.Middleware{
		func(ctx context.Context, tx pgx.Tx, info consumer.HandlerInfo, next func(context.Context, pgx.Tx) error) error {
			if info.EventID == "filtered" {
				return nil
			}
			return next(ctx, tx)
		},
	}
	var mu sync.Mutex
	outcomes := map[string]consumer.Outcome{}
	var committed []string
	cfg.Hooks.OnOutcome = func(_ context.Context, o consumer.Outcome) {
		mu.Lock()
		defer mu.Unlock()
		outcomes[o.EventID] = o
	}
	cfg.Hooks.AfterCommit = func(_ context.Context, events []consumer.Committed) {
		mu.Lock()
		defer mu.Unlock()
		for _, e := range events {
			committed = append(committed, e.EventID)
		}
	}
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, 2))
	require.NoError(t, stop())
	assert.Equal(t, map[string]int{"kept": 1}, countEffects(t, pool))
	st := c.Stats()
	assert.Equal(t, uint64(1), st.Handled, "handled")
	assert.Equal(t, uint64(1), st.Skipped, "skipped")
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, consumer.ResultSkipped, outcomes["filtered"].Result)
	assert.Zero(t, outcomes["filtered"].Runs, "the handler never ran")
	assert.Equal(t, consumer.ResultHandled, outcomes["kept"].Result)
	assert.Equal(t, []string{"kept"}, committed)
	var recorded bool
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT EXISTS (SELECT FROM processed_events WHERE consumer = $1 AND event_id = 'filtered')`, cfg.Name).Scan(&recorded))
	assert.True(t, recorded, "a skipped event is recorded as processed")
}
