package amqp_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
)

// TestPassiveSourceWithOneChannelPerConnection: a broker (or a URL's
// channel_max) that allows one channel per connection leaves the passive
// source no second channel to ask whether its queue is a stream. Open took
// amqp091's "channel id space exhausted" for an unreachable broker and
// retried, logging "cannot connect", until its context ended: a source
// that consumes over a single channel could never start, with a log
// pointing at the network. Without the question the source still refuses
// a stream at its first delivery (as for a user who may not ask), so Open
// consumes.
func TestPassiveSourceWithOneChannelPerConnection(t *testing.T) {
	t.Parallel()
	q := queueName(t)
	a := newAdmin(t)
	a.declare(q, amqp.QueueClassic)
	a.declare(q+amqp.DeadLetterQueueSuffix, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	src, err := amqp.Open(ctx, amqp.Config{URL: brokerURL(t) + "?channel_max=1", Queue: q, Passive: true,
		ReconnectMinBackoff: 20 * time.Millisecond, ReconnectMaxBackoff: 500 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err, "one channel is all a passive source consumes over")
	defer src.Close()
	assert.NoError(t, ctx.Err())
	d := receive(t, src)
	assert.Equal(t, "ev-1", d.Message().ID)
	require.NoError(t, d.Ack(context.Background()))
}

// TestDeadLetterDestinationDeletedIsDeclaredAgainWithOneChannel: the
// dead-letter queue is deleted while the source runs, on a connection that
// allows one channel. The copy that found it missing marks it for
// declaring again on a new channel of the dead-letter connection, which
// cannot be opened while the old channel's close is in flight; the
// connection was dropped and the mark cleared, so the next attempt dialled
// a new connection and published without declaring, unroutable again. The
// two alternated for ever: the poison message was never dead-lettered nor
// settled (on an Ordered queue, every message behind it waited).
func TestDeadLetterDestinationDeletedIsDeclaredAgainWithOneChannel(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.cleanupQueue(q)
	dlq := q + amqp.DeadLetterQueueSuffix
	src := openSource(t, amqp.Config{URL: brokerURL(t) + "?channel_max=1", Queue: q})
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`), jsonMsg("ev-2", `{}`)))
	first := receive(t, src)
	require.NoError(t, deadLetterWithRetries(first, 1), "the dead-letter connection works")
	require.NoError(t, first.Ack(context.Background()))

	ch, err := a.channel()
	require.NoError(t, err)
	_, err = ch.QueueDelete(dlq, false, false, false)
	require.NoError(t, err)

	second := receive(t, src)
	require.NoError(t, deadLetterWithRetries(second, 6), "the dead-letter queue is declared again")
	require.NoError(t, second.Ack(context.Background()))
	got, err := a.getAll(dlq)
	require.NoError(t, err)
	require.Len(t, got, 1)
	assert.Equal(t, "ev-2", got[0].MessageId)
}
