package amqp

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// headerFrameSize must be the size RabbitMQ measures, for every field
// type a delivery's headers can hold: a copy whose properties fill a frame
// as the protocol allows (frame_max, less the frame's 8 bytes) is
// accepted, and a larger one closes the connection with FRAME_ERROR,
// reporting the size headerFrameSize gave. (RabbitMQ lets a payload up to
// frame_max itself pass, a leniency for clients that count frame_max as
// the payload's bound; the copy does not count on it.)
func TestHeaderFrameSizeIsTheBrokersMeasure(t *testing.T) {
	broker := testBrokerURL(t)
	// publish publishes a copy with every property and every field type,
	// padded to a content header of frame_max - 8 + over bytes, and
	// returns the frame_max and the error the broker closed with.
	publish := func(over int) (frameMax int, err error) {
		conn, err := amqp091.Dial(broker)
		require.NoError(t, err)
		defer conn.Close()
		ch, err := conn.Channel()
		require.NoError(t, err)
		require.NoError(t, ch.Confirm(false))
		closed := ch.NotifyClose(make(chan *amqp091.Error, 1))
		q, err := ch.QueueDeclare("", false, true, true, false, nil)
		require.NoError(t, err)
		p := amqp091.Publishing{
			ContentType: "application/json", ContentEncoding: "gzip", DeliveryMode: amqp091.Persistent, Priority: 3,
			CorrelationId: "c", ReplyTo: "r", MessageId: "m", Timestamp: time.Unix(1700000000, 0), Type: "t", AppId: "a",
			Headers: amqp091.Table{
				"pad": "", "s": "text", "x": []byte{1, 2, 3}, "t": true, "B": byte(1), "b": int8(-1), "sh": int16(-2),
				"u": uint16(2), "I": int32(-3), "i": uint32(3), "n": 4, "l": int64(-5), "f": float32(1.5), "d": 2.5,
				"D": amqp091.Decimal{Scale: 2, Value: 314}, "T": time.Unix(1700000000, 0), "V": nil,
				"A": []any{"a", int32(1), amqp091.Table{"k": "v"}, []any{true}}, "F": amqp091.Table{"k": "v", "n": int64(1)},
			},
			Body: []byte("body"),
		}
		frameMax = conn.Config.FrameSize
		require.Positive(t, frameMax)
		p.Headers["pad"] = strings.Repeat("p", frameMax-frameOverhead+over-headerFrameSize(&p))
		require.Equal(t, frameMax-frameOverhead+over, headerFrameSize(&p))
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", q.Name, true, false, p)
		if err != nil && over > 0 {
			// The broker closed the connection at the header frame while
			// the client was still writing the body's: its reason is on
			// closed (under load the close can arrive in between).
			select {
			case e := <-closed:
				require.NotNil(t, e, "publish failed (%v) and the channel closed without a reason", err)
				return frameMax, e
			case <-ctx.Done():
				t.Fatalf("publish failed (%v) and the broker gave no reason", err)
			}
		}
		require.NoError(t, err)
		ok, err := dc.WaitContext(ctx)
		require.NoError(t, err)
		if ok {
			return frameMax, nil
		}
		return frameMax, <-closed
	}
	_, err := publish(0)
	require.NoError(t, err, "a copy whose properties fill the frame")

	frameMax, err := publish(frameOverhead + 1)
	var ae *amqp091.Error
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, amqp091.FrameError, ae.Code)
	assert.Contains(t, ae.Reason, fmt.Sprintf("{frame_too_large,%d,", frameMax+1), "the broker measured what headerFrameSize did")
}
