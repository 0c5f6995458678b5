package kafka

import (
	"context"
	"fmt"
	"hash/fnv"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// laneIndex is the key lane of key among lanes (the adapter's hash).
func laneIndex(key string, lanes int) uint32 {
	h := fnv.New32a()
	h.Write([]byte(key))
	return h.Sum32() % uint32(lanes)
}

// keysOffLane returns n distinct keys whose lane is not the lane of avoid.
func keysOffLane(avoid string, lanes, n int) []string {
	var out []string
	for i := 0; len(out) < n; i++ {
		k := fmt.Sprintf("key-%d", i)
		if laneIndex(k, lanes) != laneIndex(avoid, lanes) {
			out = append(out, k)
		}
	}
	return out
}

// With key lanes, one stuck key does not let a partition's pending records
// grow without bound: once Config.MaxPendingPerPartition records are handed
// out and not yet marked, the partition's fetching stops until the oldest
// is acked. The other keys' records before the bound are handled; when the
// stuck key is released, everything is handled exactly once.
func TestStuckKeyBoundsPendingRecords(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		c := newClusterOf(t, kind)
		topic, group := uniq("orders"), uniq("g")
		c.createTopic(topic, 1)
		const lanes, bound, others = 4, 50, 400
		msgs := []*sarama.ProducerMessage{{Topic: topic, Key: sarama.StringEncoder("stuck"),
			Value: sarama.StringEncoder(`{"n":0}`), Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte("ev-0")}}}}
		keys := keysOffLane("stuck", lanes, 8)
		for i := 1; i <= others; i++ {
			msgs = append(msgs, &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(keys[i%len(keys)]),
				Value:   sarama.StringEncoder(fmt.Sprintf(`{"n":%d}`, i)),
				Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(fmt.Sprintf("ev-%d", i))}}})
		}
		c.produceHashed(msgs)

		db, _ := pgtest.Schema(t)
		_, err := db.Exec(context.Background(), effectsTable)
		require.NoError(t, err)
		cfg := c.config(group, topic)
		cfg.KeyLanes = lanes
		cfg.MaxPendingPerPartition = bound
		src, err := Open(t.Context(), cfg)
		require.NoError(t, err)
		release := make(chan struct{})
		ccfg := consumerConfig("orders-svc")
		ccfg.HandlerTimeout = time.Minute
		r := startConsumer(t, db, src, ccfg, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
			if ev.ID == "ev-0" {
				select {
				case <-release:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return recordEffect(ctx, tx, ev)
		})

		// The partition's records are handed out up to the bound, then the
		// claim waits for room: nothing more can be received.
		require.Eventually(t, func() bool { return src.claimsWaitingForRoom() == 1 }, 30*time.Second, 5*time.Millisecond,
			"the claim stops at the bound")
		require.Eventually(t, func() bool { return len(effectCounts(t, db)) == bound-1 }, 30*time.Second, 5*time.Millisecond,
			"the other keys' records within the bound are handled")
		assert.Equal(t, uint64(bound), r.c.Stats().Received, "no record beyond the bound was received")
		assert.Equal(t, bound, src.maxPendingSeen(), "the pending records never passed the bound")
		assert.Equal(t, map[int32]int64{0: -1}, c.committed(group, topic, 1), "nothing is marked past the stuck record")

		close(release)
		waitEffects(t, db, others+1, 60*time.Second)
		require.Eventually(t, func() bool { return c.committed(group, topic, 1)[0] == others+1 }, 30*time.Second, 10*time.Millisecond)
		require.NoError(t, r.stop())
		requireExactlyOnce(t, db, "ev", others+1)
		assert.LessOrEqual(t, src.maxPendingSeen(), bound)
	})
}

// MaxPendingPerPartition bounds the records held pending, not what a crash
// redelivers: the records acked since the last periodic commit
// (CommitInterval) are marked but not committed, and a crash delivers them
// again however many they are. The docs said a crash redelivers at most
// MaxPendingPerPartition records per partition.
func TestCrashRedeliveryIsNotBoundedByMaxPending(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	const bound, acked = 5, 40
	var msgs []*sarama.ProducerMessage
	for i := range acked {
		msgs = append(msgs, msg(topic, 0, fmt.Sprint(i)))
	}
	c.produce(msgs...)
	cfg := c.config(group, topic)
	cfg.MaxPendingPerPartition = bound
	cfg.CommitInterval = time.Hour // no periodic commit within the test
	s := c.open(cfg)
	for range acked {
		d := receive(t, s)
		require.NoError(t, d.Ack(t.Context()))
	}
	require.LessOrEqual(t, s.maxPendingSeen(), bound, "the pending records stay within the bound")
	// Every record is acked and marked, none committed: a crash now would
	// deliver all of them again, eight times the bound.
	assert.Equal(t, map[int32]int64{0: -1}, c.committed(group, topic, 1))
}
