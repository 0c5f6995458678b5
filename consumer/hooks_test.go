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
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

type ctxKey struct{}

// Hooks see every outcome and retry; AfterCommit runs only once the
// effects are visible to others; middleware wraps each handler call, in
// order, inside its transaction; a panicking hook changes nothing.
func TestHooks(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "ok", 1)
	publish(b, "ok", 1) // a duplicate
	publish(b, "flaky", 2)
	publish(b, "bad", 3)

	var mu sync.Mutex
	outcomes := map[string][]consumer.Result{}
	var retries []consumer.Retry
	var committed []string
	var trail []string
	done := make(chan struct{})
	cfg := fastConfig("hooks")
	cfg.Hooks = consumer.Hooks{
		OnOutcome: func(ctx context.Context, o consumer.Outcome) {
			mu.Lock()
			defer mu.Unlock()
			outcomes[o.EventID] = append(outcomes[o.EventID], o.Result)
			if o.Result == consumer.ResultDeadLettered {
				assert.Equal(t, consumer.KindHandler, o.DeadLetter.Kind)
			}
			if len(outcomes["ok"])+len(outcomes["flaky"])+len(outcomes["bad"]) == 4 {
				close(done)
			}
			panic("a bug in the hook") // logged, and nothing else happens
		},
		OnRetry: func(ctx context.Context, r consumer.Retry) {
			mu.Lock()
			defer mu.Unlock()
			retries = append(retries, r)
		},
		AfterCommit: func(ctx context.Context, events []consumer.Committed) {
			for _, ev := range events {
				// Visible from another connection: committed.
				var n int
				// assert, not require: this runs in the consumer's goroutine,
				// where FailNow would end that goroutine, not the test.
				assert.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE event_id = $1`, ev.EventID).Scan(&n))
				assert.Equal(t, 1, n, ev.EventID)
				mu.Lock()
				committed = append(committed, ev.EventID)
				mu.Unlock()
			}
		},
		Middleware: []consumer.Middleware{
			func(ctx context.Context, tx pgx.Tx, info consumer.HandlerInfo, next func(context.Context, pgx.Tx) error) error {
				mu.Lock()
				trail = append(trail, "outer "+info.EventID)
				mu.Unlock()
				return next(context.WithValue(ctx, ctxKey{}, info.Attempt), tx)
			},
			func(ctx context.Context, tx pgx.Tx, info consumer.HandlerInfo, next func(context.Context, pgx.Tx) error) error {
				mu.Lock()
				trail = append(trail, "inner "+info.EventID)
				mu.Unlock()
				return next(ctx, tx)
			},
		},
	}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		assert.Equal(t, ev.Attempt, ctx.Value(ctxKey{}), "the middleware's context reaches the handler")
		switch {
		case ev.ID == "flaky" && ev.Attempt == 1:
			return errors.New("once")
		case ev.ID == "bad":
			return consumer.Permanent(errors.New("never"))
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("not every outcome was reported")
	}
	require.NoError(t, stop())
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, map[string][]consumer.Result{
		"ok":    {consumer.ResultHandled, consumer.ResultDuplicate},
		"flaky": {consumer.ResultHandled},
		"bad":   {consumer.ResultDeadLettered},
	}, outcomes)
	assert.ElementsMatch(t, []string{"ok", "flaky"}, committed)
	require.NotEmpty(t, retries)
	assert.Equal(t, consumer.RetryHandler, retries[0].Reason)
	assert.Equal(t, "flaky", retries[0].EventID)
	require.GreaterOrEqual(t, len(trail), 2)
	assert.Equal(t, []string{"outer ok", "inner ok"}, trail[:2])
	requireEffectsOnce(t, pool, 2)
}

// countingTx is a middleware's own pgx.Tx around the consumer's: a tracing
// or metrics wrapper, say, that counts the statements sent through it.
type countingTx struct {
	pgx.Tx
	execs *atomic.Int32
}

func (c countingTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c.execs.Add(1)
	return c.Tx.Exec(ctx, sql, args...)
}

// A middleware may hand the handler a tx of its own that wraps the
// consumer's. Event.Queue still works in that handler (its statements go
// out before the wrapper's, in the event's transaction) instead of
// panicking as if the event had not come from the consumer, which
// dead-lettered every message as a panic.
func TestQueueThroughAMiddlewaresWrappedTx(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := 0; i < 20; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	var execs atomic.Int32
	cfg := fastConfig("wrapped-tx")
	cfg.Hooks.Middleware = []consumer.Middleware{
		func(ctx context.Context, tx pgx.Tx, _ consumer.HandlerInfo, next func(context.Context, pgx.Tx) error) error {
			return next(ctx, countingTx{Tx: tx, execs: &execs})
		},
	}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N)
		// Sent through the wrapper after the queued insert: it sees it.
		var n int
		if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM effects WHERE event_id = $1`, ev.ID).Scan(&n); err != nil {
			return err
		}
		if n != 1 {
			return consumer.Permanent(fmt.Errorf("the queued insert of %s ran %d times before the handler's read", ev.ID, n))
		}
		return nil
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 20 }, 20*time.Second, 5*time.Millisecond)
	assert.Empty(t, b.DeadLetters())
	requireEffectsOnce(t, pool, 20)
	assert.Equal(t, int32(20), execs.Load(), "the handler's statements went through the middleware's tx")
}

// Every message received and given up at shutdown is reported to OnOutcome
// as abandoned: the one whose handler the shutdown deadline cut short, and
// the ones that waited behind it and never started.
func TestOnOutcomeReportsMessagesAbandonedBeforeTheyStarted(t *testing.T) {
	for _, tc := range []struct {
		name    string
		streams int
	}{{"ordered", 1}, {"unordered", 0}} {
		t.Run(tc.name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: tc.streams})
			for _, id := range []string{"a1", "a2", "a3"} {
				publishKeyed(b, "one key", id, 1)
			}
			var mu sync.Mutex
			outcomes := map[string][]consumer.Result{}
			started := make(chan struct{})
			cfg := fastConfig("abandoned-" + tc.name)
			cfg.Concurrency = 1
			cfg.Batch.Size = 1
			cfg.ShutdownTimeout = 50 * time.Millisecond
			cfg.Hooks.OnOutcome = func(_ context.Context, o consumer.Outcome) {
				mu.Lock()
				defer mu.Unlock()
				outcomes[o.EventID] = append(outcomes[o.EventID], o.Result)
			}
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				close(started) // a1 only: the others never start
				<-ctx.Done()   // until the shutdown deadline
				return ctx.Err()
			}
			c, err := consumer.New(pool, b.Source(), h, cfg)
			require.NoError(t, err)
			stop := start(t, c)
			<-started
			require.Eventually(t, func() bool { return c.Stats().Received == 3 }, 10*time.Second, time.Millisecond)
			require.NoError(t, stop())

			assert.Zero(t, b.Acked())
			mu.Lock()
			defer mu.Unlock()
			assert.Equal(t, map[string][]consumer.Result{
				"a1": {consumer.ResultAbandoned},
				"a2": {consumer.ResultAbandoned},
				"a3": {consumer.ResultAbandoned},
			}, outcomes)
		})
	}
}

// OnRetry for a dead-letter write that waits for its destination names the
// message that waits, as for a handler's retry.
func TestOnRetryOfADeadLetterWriteNamesItsMessage(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1})
	b.Publish(consumer.Message{Value: []byte("not json"), Headers: map[string]string{"id": "poison"}})
	b.SetDeadLetterError(errors.New("dead-letter queue unavailable"))
	var mu sync.Mutex
	var retries []consumer.Retry
	cfg := fastConfig("dlq-down-retry")
	cfg.Hooks.OnRetry = func(_ context.Context, r consumer.Retry) {
		mu.Lock()
		defer mu.Unlock()
		if retries = append(retries, r); len(retries) == 2 {
			b.SetDeadLetterError(nil)
		}
	}
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return b.IsAcked(0) }, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, retries, 2)
	for _, r := range retries {
		assert.Equal(t, consumer.RetryInfrastructure, r.Reason)
		assert.Equal(t, "poison", r.EventID)
		assert.Equal(t, 1, r.Messages)
	}
}

// Outcome.Runs counts every run of the handler for the message, the one
// that committed included: 1 for a message handled at once, as many as its
// Event.Attempt reached otherwise, none for a duplicate; for a BatchHandler
// too.
func TestOutcomeRunsCountsTheHandlersRuns(t *testing.T) {
	for _, batched := range []bool{false, true} {
		t.Run(fmt.Sprintf("batched=%v", batched), func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "ok", 1)
			publish(b, "ok", 1) // a duplicate
			publish(b, "flaky", 2)
			publish(b, "bad", 3)
			publish(b, "after", 4)

			var mu sync.Mutex
			runs := map[string][]int{}
			reported := make(chan struct{}, 8)
			cfg := fastConfig("runs")
			cfg.Batch.Size = 8
			cfg.Hooks.OnOutcome = func(_ context.Context, o consumer.Outcome) {
				mu.Lock()
				runs[o.EventID] = append(runs[o.EventID], o.Runs)
				mu.Unlock()
				reported <- struct{}{}
			}
			fail := func(ev consumer.Event[order]) error {
				switch {
				case ev.ID == "flaky" && ev.Attempt == 1:
					return errors.New("once")
				case ev.ID == "bad":
					return consumer.Permanent(errors.New("never"))
				}
				return nil
			}
			var c *consumer.Consumer[order]
			var err error
			if batched {
				c, err = consumer.NewBatch(pool, b.Source(), func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
					for _, ev := range evs {
						if err := fail(ev); err != nil {
							return err
						}
					}
					return insertEffects(ctx, tx, evs)
				}, cfg)
			} else {
				c, err = consumer.New(pool, b.Source(), func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
					if err := fail(ev); err != nil {
						return err
					}
					return insertEffect(ctx, tx, ev)
				}, cfg)
			}
			require.NoError(t, err)
			start(t, c)
			for range 5 { // OnOutcome runs after the ack: wait for it
				select {
				case <-reported:
				case <-time.After(10 * time.Second):
					t.Fatal("not every outcome was reported")
				}
			}
			mu.Lock()
			defer mu.Unlock()
			assert.Equal(t, map[string][]int{"ok": {1, 0}, "flaky": {2}, "bad": {1}, "after": {1}}, runs)
		})
	}
}

// Middleware wraps a Handler's calls, each with one event. A BatchHandler's
// calls carry batches of 1 to Batch.Size events as the load makes them: a
// middleware there would run for the batches of one only, under light load
// (a tenant set with SET LOCAL, say, missing under heavy load). NewBatch
// refuses it; wrap the BatchHandler itself.
func TestNewBatchRefusesMiddleware(t *testing.T) {
	cfg := consumer.Config{Name: "batch-mw", Hooks: consumer.Hooks{Middleware: []consumer.Middleware{
		func(ctx context.Context, tx pgx.Tx, info consumer.HandlerInfo, next func(context.Context, pgx.Tx) error) error {
			return next(ctx, tx)
		},
	}}}
	h := func(context.Context, pgx.Tx, []consumer.Event[order]) error { return nil }
	_, err := consumer.NewBatch(nil, memsource.New(memsource.Options{}).Source(), h, cfg)
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "Hooks.Middleware")
}
