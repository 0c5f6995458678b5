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

// brokenError is a user's error type whose Error method panics (a nil
// field it formats, say).
type brokenError struct{ detail *string }

func (e *brokenError) Error() string { return "refused: " + *e.detail }

// An error the handler returns is read (its Error method) to classify,
// log and dead-letter it, outside the handler's recover: an error type
// whose Error panicked crashed the process, every stream with it, and the
// message crashed each process after until the crash guard gave up on it.
// Such an error is the handler's panic: dead-lettered with kind panic,
// the neighbours handled.
func TestHandlerErrorWhoseErrorMethodPanicsIsAPanic(t *testing.T) {
	unreadableErrorIsAPanic(t, "broken-error", func() error { return &brokenError{} }, "the Error method of the handler's error")
}

// unreadableErrorIsAPanic runs a handler and a batch handler, each on a
// message "broken" whose handler returns broken() and a message "fine",
// and requires the first dead-lettered with kind panic, its error message
// holding method, and the second handled.
func unreadableErrorIsAPanic(t *testing.T, name string, broken func() error, method string) {
	for _, batch := range []bool{false, true} {
		t.Run(map[bool]string{false: "handler", true: "batch handler"}[batch], func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "broken", 1)
			publish(b, "fine", 2)
			cfg := fastConfig(name)
			var c *consumer.Consumer[order]
			var err error
			if batch {
				c, err = consumer.NewBatch(pool, b.Source(), func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
					for _, ev := range evs {
						if ev.ID == "broken" {
							return broken()
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
						return broken()
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
			assert.Contains(t, deadLetterOf(t, b, "broken").Headers[consumer.HeaderErrorMessage], method)
			requireEffectsOnce(t, pool, 1)
		})
	}
}
