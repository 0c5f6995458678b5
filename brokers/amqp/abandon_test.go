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
)

// A broker disconnect is an infrastructure failure, not poison (guarantee
// 5): a message whose handling is cut short by four lost connections in a
// row, in a process that never crashes, must still be handled once, not
// dead-lettered as crash-loop.
func TestDisconnectsDuringHandlingAreNotCrashes(t *testing.T) {
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, jsonMsg("slow-1", `{"n":1}`)))
	pool := effectsDB(t)
	p, proxied := startProxy(t, brokerURL(t))
	src := openSource(t, amqp.Config{URL: proxied, Queue: q})
	var started atomic.Int64
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
		if started.Add(1) <= 4 {
			<-ctx.Done() // a long handler; the channel dies under it
			return ctx.Err()
		}
		return recordEffect(ctx, tx, ev)
	}
	r := startConsumer(t, pool, src, consumer.Config{Name: "abandon-test"}, h)
	for i := int64(1); i <= 4; i++ {
		require.Eventually(t, func() bool { return started.Load() == i }, 30*time.Second, 5*time.Millisecond, "delivery %d started", i)
		cutTheConnection(t, p)
	}
	require.Eventually(t, func() bool { s := r.c.Stats(); return s.Handled+s.DeadLettered == 1 }, 30*time.Second, 5*time.Millisecond)
	assert.Equal(t, uint64(0), r.c.Stats().DeadLettered, "no process crashed: the message must not be dead-lettered as crash-loop")
	assert.Equal(t, uint64(1), r.c.Stats().Handled)
}
