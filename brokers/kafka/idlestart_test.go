package kafka

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// With OffsetsInDatabase and StartNewest, the start of a partition that
// received no record while the consumer ran was committed to Kafka alone
// (markStarts): the offsets table kept no position for it. When Kafka then
// forgot the group's offsets (offsets.retention.minutes, the group deleted
// or renamed), the restart took the partition for new, started at its end
// again, and the records produced to it while the consumer was away were
// never handled: exactly the loss docs/kafka.md says OffsetsInDatabase
// prevents ("keeps the position with the effects and starts there
// instead").
func TestOffsetsInDatabaseStartNewestKeepsTheStartOfAnIdlePartitionWhenKafkaForgetsIt(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 2)
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	rec := func(p int32, n int) *sarama.ProducerMessage {
		return msg(topic, p, fmt.Sprintf(`{"n":%d}`, n), "id", fmt.Sprintf("ev-%d", n))
	}
	// Before the group starts: not read, StartNewest.
	c.produce(rec(0, 100), rec(1, 101))

	cfg := c.dbOffsetsConfig(group, topic)
	cfg.InitialOffset = StartNewest
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	r := startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
	// Partition 1's start is committed by the session's Setup; then
	// partition 0 gets records, partition 1 none.
	require.Eventually(t, func() bool {
		admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
		if err != nil {
			return false
		}
		defer admin.Close()
		resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: {1}})
		if err != nil {
			return false
		}
		b := resp.GetBlock(topic, 1)
		return b != nil && b.Offset == 1
	}, 30*time.Second, 20*time.Millisecond, "partition 1's start committed")
	c.produce(rec(0, 0), rec(0, 1))
	waitEffectsByN(t, db, 2)
	require.NoError(t, r.stop())

	// While the consumer is stopped: records to the idle partition, and
	// the group's offsets are lost.
	c.produce(rec(1, 2), rec(1, 3))
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(t, err)
	require.NoError(t, admin.DeleteConsumerGroup(group))
	require.NoError(t, admin.Close())

	src, err = Open(t.Context(), cfg)
	require.NoError(t, err)
	r = startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
	defer func() { _ = r.stop() }()
	require.Eventually(t, func() bool { return len(effectsByN(t, db)) >= 4 }, 15*time.Second, 20*time.Millisecond,
		"the records produced to the idle partition while the consumer was away are handled; got %v", effectsByN(t, db))
	require.NoError(t, r.stop())
	assert.Equal(t, map[int]int{0: 1, 1: 1, 2: 1, 3: 1}, effectsByN(t, db))
}
