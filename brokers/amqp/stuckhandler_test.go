package amqp_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// TestHandlerOutlastingTheConsumerTimeoutIsDeadLettered: a handler slower
// than the broker's consumer_timeout loses its delivery every time (the
// broker closes the channel). Once redelivered, each of its runs cut so
// counts as a crash, and the message is dead-lettered crash-loop after
// CrashGuard.MaxCrashes of them, instead of looping for ever; the other
// messages, cut beside it and redelivered, each have their effect once.
func TestHandlerOutlastingTheConsumerTimeoutIsDeadLettered(t *testing.T) {
	t.Parallel()
	n := shortConsumerTimeoutNode(t)
	a := newAdminAt(t, n.url)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	ids := eventIDs("flow", 20)
	require.NoError(t, a.publish("", q, messagesFor(ids[:10])...))
	require.NoError(t, a.publish("", q, jsonMsg("stuck", `{"n":-1}`)))
	require.NoError(t, a.publish("", q, messagesFor(ids[10:])...))
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(ctx, effectsDDL)
	require.NoError(t, err)

	var stuckRuns atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
		if ev.ID == "stuck" {
			stuckRuns.Add(1)
			select {
			case <-ctx.Done(): // the delivery lost past consumer_timeout
				return ctx.Err()
			case <-time.After(time.Minute):
				return nil
			}
		}
		return recordEffect(ctx, tx, ev)
	}
	src := openSource(t, amqp.Config{URL: n.url, Queue: q})
	startConsumer(t, pool, src, consumer.Config{Name: "outlasts-consumer-timeout", Concurrency: 2}, h)

	require.Eventually(t, func() bool {
		dead, err := a.ready(q + amqp.DeadLetterQueueSuffix)
		return err == nil && dead == 1
	}, 60*time.Second, 50*time.Millisecond, "the stuck message was never dead-lettered")
	dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, dead, 1)
	h2 := amqp.HeaderStrings(dead[0].Headers)
	assert.Equal(t, string(consumer.KindCrashLoop), h2[consumer.HeaderErrorKind])
	assert.Equal(t, "stuck", h2[consumer.HeaderEventID])
	// One uncounted run, then CrashGuard.MaxCrashes (3) counted ones.
	assert.LessOrEqual(t, stuckRuns.Load(), int32(4), "the message ran more often than its crash limit allows")
	require.Eventually(t, func() bool {
		ready, unacked := n.queueCounts(t, q)
		return ready == 0 && unacked == 0
	}, 20*time.Second, 20*time.Millisecond, "every message settled")
	requireExactlyOnce(t, pool, ids)
}
