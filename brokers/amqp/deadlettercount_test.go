package amqp_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/netcut"
)

// losingAcks is a source whose deliveries' first Ack after a dead letter
// is lost with the connection: it cuts every connection through the
// proxy, waits for the delivery's context to end, then acks, as a
// connection lost between the copy's confirm and the ack would.
type losingAcks struct {
	consumer.Source
	proxy *netcut.Proxy
	lost  atomic.Bool
}

func (s *losingAcks) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return &losingAck{Delivery: d, src: s}, nil
}

type losingAck struct {
	consumer.Delivery
	src          *losingAcks
	deadLettered bool
}

func (d *losingAck) DeadLetter(ctx context.Context, dl *consumer.DeadLetter) error {
	err := d.Delivery.DeadLetter(ctx, dl)
	d.deadLettered = err == nil
	return err
}

func (d *losingAck) Ack(ctx context.Context) error {
	if d.deadLettered && d.src.lost.CompareAndSwap(false, true) {
		d.src.proxy.Cut()
		select {
		case <-d.Context().Done():
		case <-time.After(20 * time.Second):
		}
	}
	return d.Delivery.Ack(ctx)
}

// TestDeadLetteredCountsCopies: a poison message whose copy was confirmed
// and whose ack was then lost with the connection comes again, is
// dead-lettered again, and the dead-letter queue holds two copies with the
// same once-event-id (dead letters are at least once). Stats.DeadLettered
// counts the copies written, two, as its documentation says: the consumer
// has no record of a message dead-lettered before (it writes none in the
// database, and the broker redelivers it as any unacked message).
func TestDeadLetteredCountsCopies(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.cleanupQueue(q)
	p, through := startProxy(t, brokerURL(t))
	src := &losingAcks{Source: openSource(t, amqp.Config{URL: through, Queue: q}), proxy: p}
	pool := effectsDB(t)
	r := startConsumer(t, pool, src, consumer.Config{Name: "dl-count",
		InfraBackoff: consumer.Backoff{Initial: 10 * time.Millisecond, Max: 100 * time.Millisecond}}, recordEffect)
	require.NoError(t, a.publish("", q, amqp091.Publishing{MessageId: "bad-1", Body: []byte(`not json`)}))

	require.Eventually(t, func() bool { return r.c.Stats().DeadLettered == 2 }, 30*time.Second, 10*time.Millisecond,
		"the redelivered message is dead-lettered again; stats %+v", r.c.Stats())
	require.Eventually(t, func() bool {
		n, err := a.ready(q)
		return err == nil && n == 0
	}, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, r.stop())
	assert.True(t, src.lost.Load(), "no ack was lost")
	assert.Equal(t, uint64(2), r.c.Stats().DeadLettered)
	got, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, got, 2, "one copy per dead letter written")
	for _, c := range got {
		assert.Equal(t, "bad-1", c.Headers["once-event-id"])
	}
}
