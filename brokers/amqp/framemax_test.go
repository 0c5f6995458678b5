package amqp_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
)

// TestMessageWithHeadersOverTheClientsDefaultFrameIsDelivered: a broker
// whose frame_max is raised above 128 KiB accepts, from a publisher that
// negotiated its frame size, a message whose properties take more than
// 128 KiB (a content header frame is never split). The source must read
// it: it is the broker's frame_max that bounds what it delivers.
func TestMessageWithHeadersOverTheClientsDefaultFrameIsDelivered(t *testing.T) {
	t.Parallel()
	n := privateNode(t)
	n.ctl(t, "eval", "application:set_env(rabbit, frame_max, 1048576).")

	conn, err := amqp091.DialConfig(n.url, amqp091.Config{FrameSize: 1 << 20})
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	require.Equal(t, 1<<20, conn.Config.FrameSize, "the broker's frame_max was raised")
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	q := queueName(t)
	_, err = ch.QueueDeclare(q, true, false, false, false, nil)
	require.NoError(t, err)
	big := amqp091.Table{"trace": strings.Repeat("x", 200_000)}
	dc, err := ch.PublishWithDeferredConfirm("", q, false, false,
		amqp091.Publishing{MessageId: "big-headers", Body: []byte(`{}`), Headers: big, DeliveryMode: amqp091.Persistent})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ok, err := dc.WaitContext(ctx)
	require.NoError(t, err)
	require.True(t, ok, "the broker took the message")

	var logs syncBuffer
	src := openSource(t, amqp.Config{URL: n.url, Queue: q,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	rctx, rcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer rcancel()
	d, err := src.Receive(rctx)
	require.NoError(t, err, "the source cannot read the message; logs:\n%s", logs.String())
	assert.Equal(t, "big-headers", d.Message().ID)
	require.NoError(t, d.Ack(context.Background()))
}
