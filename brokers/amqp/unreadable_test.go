package amqp_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/onceco/once/brokers/amqp"
)

// A message whose properties the client library refuses to read (a header
// table of more than 8192 entries: amqp091 closes the connection with a
// syntax error) is delivered again first on every new connection, and the
// session dies at once each time. The source reconnected at once after
// each such session, hundreds of times a second, since its backoff began
// afresh after every successful connection. Sessions that die before
// delivering anything now back off like failed attempts, and the error
// says that a message the client cannot read holds the queue.
func TestUnreadableMessageDoesNotSpinTheReconnects(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	h := amqp091.Table{}
	for i := range 8200 {
		h[fmt.Sprintf("h%d", i)] = nil
	}
	require.NoError(t, a.publish("", q, amqp091.Publishing{MessageId: "unreadable", Body: []byte(`{}`), Headers: h}))

	rd := sdkmetric.NewManualReader()
	var logs syncBuffer
	src := openSource(t, amqp.Config{Queue: q,
		ReconnectMinBackoff: 20 * time.Millisecond, ReconnectMaxBackoff: 500 * time.Millisecond,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd)),
		Logger:        slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	d, err := src.Receive(ctx)
	require.Nil(t, d, "the message cannot be read")
	require.True(t, errors.Is(err, context.DeadlineExceeded), "%v", err)
	n := counterValue(t, rd, amqp.ReconnectsMetric)
	assert.LessOrEqual(t, n, int64(20), "reconnects in 2 s with a backoff of 20-500 ms")
	assert.True(t, strings.Contains(logs.String(), "cannot read a message"), "the log says why the connection keeps closing")
}
