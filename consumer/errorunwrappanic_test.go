package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// wrapError is a user's wrapping error type whose Unwrap panics (it
// reaches into a nil cause, say); its Error method is fine.
type wrapError struct{ cause *wrapError }

func (e *wrapError) Error() string { return "wrapped" }
func (e *wrapError) Unwrap() error { return e.cause.cause }

// An error the handler returns is unwrapped (errors.As, errors.Is) to
// classify it, outside the handler's recover, as it is read: one whose
// Unwrap panics is the handler's panic, dead-lettered with kind panic,
// the message after it handled. It crashed the process, every stream
// with it, as an Error method that panicked did before
// TestHandlerErrorWhoseErrorMethodPanicsIsAPanic's fix.
func TestHandlerErrorWhoseUnwrapPanicsIsAPanic(t *testing.T) {
	for _, batch := range []bool{false, true} {
		name := map[bool]string{false: "handler", true: "batch handler"}[batch]
		t.Run(name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "broken", 1)
			publish(b, "fine", 2)
			cfg := fastConfig("broken-unwrap")
			var c *consumer.Consumer[order]
			var err error
			if batch {
				c, err = consumer.NewBatch(pool, b.Source(), func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
					for _, ev := range evs {
						if ev.ID == "broken" {
							return &wrapError{}
						}
					}
					for _, ev := range evs {
						if err := insertEffect(ctx, tx, ev); err != nil {
							return err
						}
					}
					return nil
				}, cfg)
			} else {
				c, err = consumer.New(pool, b.Source(), func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
					if ev.ID == "broken" {
						return &wrapError{}
					}
					return insertEffect(ctx, tx, ev)
				}, cfg)
			}
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- c.Run(ctx) }()
			waitCtx, stopWaiting := context.WithTimeout(ctx, 20*time.Second)
			defer stopWaiting()
			require.NoError(t, b.WaitEachAcked(waitCtx, 2))
			cancel()
			require.NoError(t, <-done)
			assert.Equal(t, map[string]string{"broken": string(consumer.KindPanic)}, deadLetterKinds(b))
			assert.Contains(t, deadLetterOf(t, b, "broken").Headers[consumer.HeaderErrorMessage], "the Unwrap or Is method of the handler's error")
			requireEffectsOnce(t, pool, 1)
		})
	}
}
