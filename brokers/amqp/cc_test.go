package amqp_test

import (
	"context"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// A message published with sender-selected distribution (a CC header
// naming more routing keys, here by queue name on the default exchange)
// keeps its CC header when delivered. Its dead-letter copy carried it
// over, and the broker routed the copy by it as well: into the other
// queue, and back into the source queue, where the consumer handled the
// dead letter again, failed again and dead-lettered it again, without
// end. The copy goes to the dead-letter destination alone, with the CC
// header kept as once-original-cc.
func TestDeadLetterCopyIsNotRoutedByTheOriginalsCC(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q, other := queueName(t), queueName(t)
	a.declare(q, amqp.QueueClassic)
	a.declare(other, amqp.QueueClassic)
	cc := []any{q, other}
	require.NoError(t, a.publish("", q, amqp091.Publishing{MessageId: "ev-1", Body: []byte(`{"n":1}`),
		Headers: amqp091.Table{"CC": cc, "x-origin": "test"}}))
	src := openSource(t, amqp.Config{Queue: q})
	d := receive(t, src)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, d.DeadLetter(ctx, &consumer.DeadLetter{Consumer: "cc", EventID: "ev-1", Kind: consumer.KindHandler,
		Attempts: 3, Error: "always fails", FailedAt: time.Now()}))
	require.NoError(t, d.Ack(ctx))
	require.NoError(t, src.Close())

	dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, dead, 1)
	assert.NotContains(t, dead[0].Headers, "CC")
	assert.Equal(t, cc, dead[0].Headers[amqp.HeaderOriginalCC], "kept, under a name the broker does not route by")
	assert.Equal(t, "test", dead[0].Headers["x-origin"])
	back, err := a.getAll(q)
	require.NoError(t, err)
	assert.Empty(t, back, "no copy back in the source queue")
	others, err := a.getAll(other)
	require.NoError(t, err)
	assert.Len(t, others, 1, "the original alone in the other queue")
}
