package amqp_test

import (
	"context"
	"log/slog"
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/onceco/once/brokers/amqp"
)

// TestDeadLetterNackedByAFullQueueIsAnError: a dead-letter queue with a
// length limit and x-overflow reject-publish (the overflow docs/amqp.md
// presents as the one that loses nothing) nacks every copy once it is
// full, until someone drains it. No retry cures that: each nack is logged
// at level Error, saying what refuses the copy and what to do, and
// counted in DeadLetterRefusalsMetric, not logged as a passing failure
// ("the broker nacked it"); the delivery stays unacked, and the copy goes
// out once the queue has room again.
func TestDeadLetterNackedByAFullQueueIsAnError(t *testing.T) {
	a := newAdmin(t)
	q := queueName(t)
	a.cleanupQueue(q)
	dlq := q + amqp.DeadLetterQueueSuffix
	logs := make(logRecords, 1024)
	rd := sdkmetric.NewManualReader()
	src := openSource(t, amqp.Config{Queue: q, Logger: slog.New(logs),
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd)),
		DeadLetter:    amqp.DeadLetterConfig{QueueArgs: amqp091.Table{"x-max-length": int32(1), "x-overflow": "reject-publish"}}})
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`), jsonMsg("ev-2", `{}`)))
	first := receive(t, src)
	require.NoError(t, deadLetterWithRetries(first, 1), "the dead-letter queue has room for one")
	require.NoError(t, first.Ack(context.Background()))

	d := receive(t, src)
	require.Equal(t, "ev-2", d.Message().ID)
	for i := 1; i <= 2; i++ {
		err := deadLetterWithRetries(d, 1)
		require.Error(t, err, "the full dead-letter queue took the copy")
		assert.Contains(t, err.Error(), "reject-publish", "the error says why the broker nacks")
		errText := awaitLog(t, logs, slog.LevelError, "nacked")
		assert.Contains(t, errText, "nacked")
		assert.Equal(t, int64(i), counterValue(t, rd, amqp.DeadLetterRefusalsMetric))
	}

	// Drained: the copy goes out.
	got, err := a.getAll(dlq)
	require.NoError(t, err)
	require.Len(t, got, 1)
	assert.Equal(t, "ev-1", got[0].MessageId)
	require.NoError(t, deadLetterWithRetries(d, 1))
	require.NoError(t, d.Ack(context.Background()))
	got, err = a.getAll(dlq)
	require.NoError(t, err)
	require.Len(t, got, 1)
	assert.Equal(t, "ev-2", got[0].MessageId)
}
