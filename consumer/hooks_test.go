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
				require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE event_id = $1`, ev.EventID).Scan(&n))
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
