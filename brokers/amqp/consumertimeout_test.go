package amqp_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
)

// TestConsumerTimeoutIsAnError: RabbitMQ closes a consuming channel one
// of whose deliveries stayed unacked longer than its consumer_timeout (30
// minutes by default), with PRECONDITION_FAILED: a handler that runs
// longer, or a message retried for longer, loses its delivery, and every
// unacked delivery of the channel is delivered again, the slow one to be
// cut again as long as it takes as long. Told apart from a lost
// connection, it is logged at level Error saying so and what bounds it
// (consumer.Config.HandlerTimeout below consumer_timeout); the source
// reconnects, the delivery cut is put back, and acking it on the new
// channel settles it.
func TestConsumerTimeoutIsAnError(t *testing.T) {
	t.Parallel()
	n := shortConsumerTimeoutNode(t)
	a := newAdminAt(t, n.url)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, jsonMsg("slow-1", `{}`)))
	logs := make(logRecords, 1024)
	src := openSource(t, amqp.Config{URL: n.url, Queue: q, Logger: slog.New(logs)})

	d := receive(t, src)
	require.Eventually(t, func() bool { return d.Context().Err() != nil }, 20*time.Second, 5*time.Millisecond,
		"the broker closes the channel past consumer_timeout")
	assert.ErrorIs(t, d.Ack(context.Background()), amqp.ErrChannelClosed)

	again := receive(t, src) // reconnects, and says why
	errText := awaitLog(t, logs, slog.LevelError, "consumer_timeout")
	assert.Contains(t, errText, "PRECONDITION_FAILED")
	assert.Equal(t, "slow-1", again.Message().ID)
	assert.True(t, again.Message().Redelivered)
	require.NoError(t, again.Ack(context.Background()))
	require.Eventually(t, func() bool {
		ready, unacked := n.queueCounts(t, q)
		return ready == 0 && unacked == 0
	}, 10*time.Second, 20*time.Millisecond, "the redelivered message was acked")
}
