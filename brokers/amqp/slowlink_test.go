package amqp_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
)

// TestDeadLetterOfACopySlowerToWriteThanConfirmTimeout: on a link too
// slow to carry a large copy within Config.ConfirmTimeout (a 100 MB body
// over a 50 Mbit/s link takes 16 s, the default timeout is 10 s), the
// timeout bounded the write as well as the confirm, as if the broker had
// blocked the connection: the connection was dropped with the partial
// copy, and every retry the same, so the message was never dead-lettered.
// A write the broker is taking is given the time it needs; only one that
// makes no progress for ConfirmTimeout is given up
// (TestDeadLetterOfALargeCopyUnderAnAlarmKeepsConfirmTimeout).
func TestDeadLetterOfACopySlowerToWriteThanConfirmTimeout(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	body := bigBody(48 << 20)
	require.NoError(t, a.publish("", q, amqp091.Publishing{MessageId: "ev-1", Body: body}))
	p, proxied := startProxy(t, brokerURL(t))
	src := openSource(t, amqp.Config{URL: proxied, Queue: q, ConfirmTimeout: 8 * time.Second})
	d := receive(t, src)
	// 4 MiB/s: the copy takes about 12 s to write, past ConfirmTimeout,
	// while what the sockets' buffers hold (at most 4 MiB on this link)
	// reaches the broker within a second or so of the write's end.
	p.Throttle(4 << 20)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	require.NoError(t, d.DeadLetter(ctx, panicDeadLetter("ev-1")), "the copy is written, however long the link takes")
	require.NoError(t, d.Ack(ctx))
	p.Throttle(0)

	dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, dead, 1, "one copy")
	require.True(t, bytes.Equal(body, dead[0].Body), "the body whole (%d bytes, got %d)", len(body), len(dead[0].Body))
}
