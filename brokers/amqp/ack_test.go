package amqp_test

import (
	"context"
	"math/rand/v2"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// TestAcksCoalescedNeverCoverUnacked acks 200 deliveries in a random
// order from several goroutines, except two; then one of those two, which
// closes a gap over acks already sent one by one. The acks are coalesced
// into fewer frames, the broker never closes the channel over a wrong
// delivery tag, and after Close exactly the unacked message is back in the
// queue.
func TestAcksCoalescedNeverCoverUnacked(t *testing.T) {
	t.Parallel()
	const n = 200
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	ids := eventIDs("ack", n)
	require.NoError(t, a.publish("", q, messagesFor(ids)...))
	src := openSource(t, amqp.Config{Queue: q, Prefetch: n})

	ds := make([]consumer.Delivery, n)
	for i := range ds {
		ds[i] = receive(t, src)
		require.Equal(t, ids[i], ds[i].Message().ID)
	}
	const late, never = 49, 119
	order := rand.Perm(n)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k, i := range order {
				if k%4 == w && i != late && i != never {
					assert.NoError(t, ds[i].Ack(context.Background()))
				}
			}
		}()
	}
	wg.Wait()
	allSent := func() bool {
		_, unsent, _ := amqp.AckStats(src)
		return unsent == 0
	}
	require.Eventually(t, allSent, 10*time.Second, time.Millisecond, "every ack is sent within the linger")
	_, _, spans := amqp.AckStats(src)
	assert.Equal(t, 2, spans, "the tags sent alone after each gap are kept as one span each")
	// Acks after the gap went out one by one; closing the gap must ack
	// only the late delivery, not name a tag acked already.
	require.NoError(t, ds[late].Ack(context.Background()))
	require.Eventually(t, allSent, 10*time.Second, time.Millisecond)
	frames, _, spans := amqp.AckStats(src)
	assert.Equal(t, 1, spans, "closing the first gap joins its span to the prefix")
	t.Logf("%d acks sent in %d frames", n-1, frames)
	assert.Less(t, frames, n-1, "acks are coalesced")

	// The channel is still open: no multiple ack named an unknown tag (the
	// broker would have closed it, and the source would deliver a probe
	// published now on a new channel, after the unacked messages).
	require.NoError(t, a.publish("", q, jsonMsg("probe", `{}`)))
	probe := receive(t, src)
	assert.Equal(t, "probe", probe.Message().ID)
	assert.False(t, probe.Message().Redelivered)
	assert.Equal(t, ds[0].Context(), probe.Context(), "same channel as before the acks")
	require.NoError(t, ds[0].Context().Err(), "the broker closed the channel: an ack named an unknown delivery tag")
	require.NoError(t, probe.Ack(context.Background()))

	require.NoError(t, src.Close())
	// The broker puts the unacked message back as it tears the channel
	// down, which may end after Close returned: wait for it to be ready
	// (a message acked by a wrong multiple ack never is).
	require.Eventually(t, func() bool {
		ready, err := a.ready(q)
		return err == nil && ready >= 1
	}, 10*time.Second, 5*time.Millisecond, "the unacked message is back in the queue")
	left, err := a.getAll(q)
	require.NoError(t, err)
	var got []string
	for _, d := range left {
		got = append(got, d.MessageId)
	}
	sort.Strings(got)
	assert.Equal(t, []string{ids[never]}, got, "exactly the unacked message comes back")
}

// TestCloseSendsPendingAcks: acks given just before Close are sent, not
// dropped with the connection.
func TestCloseSendsPendingAcks(t *testing.T) {
	t.Parallel()
	const n = 100
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, messagesFor(eventIDs("close", n))...))
	src := openSource(t, amqp.Config{Queue: q, Prefetch: n})
	for range n {
		require.NoError(t, receive(t, src).Ack(context.Background()))
	}
	require.NoError(t, src.Close())
	left, err := a.getAll(q)
	require.NoError(t, err)
	assert.Empty(t, left, "an ack was lost at Close")
}

func TestMergeSpans(t *testing.T) {
	assert.Equal(t, [][2]uint64{{1, 1}}, amqp.MergeSpans(nil, []uint64{1}))
	assert.Equal(t, [][2]uint64{{1, 3}, {5, 5}}, amqp.MergeSpans(nil, []uint64{1, 2, 3, 5}))
	assert.Equal(t, [][2]uint64{{1, 7}}, amqp.MergeSpans([][2]uint64{{1, 3}, {5, 7}}, []uint64{4}))
	assert.Equal(t, [][2]uint64{{2, 3}, {5, 9}, {20, 21}}, amqp.MergeSpans([][2]uint64{{5, 7}, {20, 20}}, []uint64{2, 3, 8, 9, 21}))
	assert.Equal(t, [][2]uint64{{1, 2}, {10, 12}}, amqp.MergeSpans([][2]uint64{{10, 12}}, []uint64{1, 2}))
}
