package consumer_test

import (
	"context"
	"errors"
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
