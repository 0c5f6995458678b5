package amqp_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
)

// DeadLetter with a nil *consumer.DeadLetter (a Source wrapping this one
// that lost it) is refused with an error, as the Kafka source refuses it:
// it panicked on the nil pointer. No copy is written, and the delivery
// stays unsettled for the caller to ack or abandon.
func TestDeadLetterRefusesANilDeadLetter(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{"n":1}`)))
	src := openSource(t, amqp.Config{Queue: q})
	d := receive(t, src)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var err error
	require.NotPanics(t, func() { err = d.DeadLetter(ctx, nil) })
	require.Error(t, err)
	require.NoError(t, d.Ack(ctx))
	dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	assert.Empty(t, dead, "no copy without a dead letter")
}
