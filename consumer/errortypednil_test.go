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

// A handler that returns a nil pointer of one of the package's error
// types (a `var perr *consumer.PermanentError` returned as an error, the
// Go pitfall of a typed nil) got a dead letter of kind panic blaming the
// package's own Error method ("the Error method of the handler's error
// (*consumer.PermanentError) panicked: runtime error: invalid memory
// address"), after Retry.MaxAttempts runs, though the error said
// permanent. The types read a nil receiver as their zero value, as they
// read a nil Err: the message fails as the type says, at once, with its
// kind, and the message after it is handled.
func TestHandlerErrorOfATypedNilIsReadAsItsType(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		kind consumer.ErrorKind
		text string
	}{
		{"permanent", (*consumer.PermanentError)(nil), consumer.KindHandler, "permanent: permanent failure"},
		{"decode", (*consumer.DecodeError)(nil), consumer.KindDecode, "decode: decode failed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "typed-nil", 1)
			publish(b, "fine", 2)
			var runs atomic.Int32
			c, err := consumer.New(pool, b.Source(), func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				if ev.ID == "typed-nil" {
					runs.Add(1)
					return tc.err
				}
				return insertEffect(ctx, tx, ev)
			}, fastConfig("typed-nil-"+tc.name))
			require.NoError(t, err)
			runUntilAcked(t, c, b, 2)
			assert.Equal(t, map[string]string{"typed-nil": string(tc.kind)}, deadLetterKinds(b))
			assert.Equal(t, tc.text, deadLetterOf(t, b, "typed-nil").Headers[consumer.HeaderErrorMessage])
			assert.Equal(t, int32(1), runs.Load(), "failed for good at once, not retried")
			requireEffectsOnce(t, pool, 1)
		})
	}
}

// A nil *RetryAfterError asks for a retry after no delay: the message is
// run again, and its effect is had once. Its Delay is read where the
// consumer waits, outside the handler's recover, where a nil pointer
// would end the process.
func TestHandlerRetryAfterOfATypedNilRetries(t *testing.T) {
	for _, batch := range []bool{false, true} {
		t.Run(map[bool]string{false: "handler", true: "batch handler"}[batch], func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "later", 1)
			var runs atomic.Int32
			var retried atomic.Value
			cfg := fastConfig("typed-nil-retry")
			cfg.Hooks.OnRetry = func(_ context.Context, r consumer.Retry) { retried.CompareAndSwap(nil, r.Err.Error()) }
			fail := func() error {
				if runs.Add(1) == 1 {
					return (*consumer.RetryAfterError)(nil)
				}
				return nil
			}
			var c *consumer.Consumer[order]
			var err error
			if batch {
				c, err = consumer.NewBatch(pool, b.Source(), func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
					if err := fail(); err != nil {
						return err
					}
					return insertEffects(ctx, tx, evs)
				}, cfg)
			} else {
				c, err = consumer.New(pool, b.Source(), func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
					if err := fail(); err != nil {
						return err
					}
					return insertEffect(ctx, tx, ev)
				}, cfg)
			}
			require.NoError(t, err)
			runUntilAcked(t, c, b, 1)
			assert.Empty(t, b.DeadLetters())
			assert.Equal(t, "retry after 0s: retry requested", retried.Load())
			requireEffectsOnce(t, pool, 1)
		})
	}
}

// runUntilAcked runs c until n messages of b are acked, then stops it.
func runUntilAcked(t *testing.T, c *consumer.Consumer[order], b *memsource.Broker, n int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	waitCtx, stopWaiting := context.WithTimeout(ctx, 30*time.Second)
	defer stopWaiting()
	require.NoError(t, b.WaitEachAcked(waitCtx, n))
	cancel()
	require.NoError(t, <-done)
}
