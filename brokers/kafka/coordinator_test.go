package kafka

import (
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
)

// The group's coordinator moves to another broker (a rolling restart
// moves the leaders of __consumer_offsets), and then a partition is added
// to a topic the group reads with StartNewest: the session that claims it
// asks the coordinator for the committed offsets, to start the added
// partition at its first record.
func TestStartNewestReadsAPartitionAddedAfterTheCoordinatorMoved(t *testing.T) {
	c := newCluster(t, kfake.NumBrokers(3))
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	db := effectsDB(t)
	cfg := c.config(group, topic)
	cfg.InitialOffset = StartNewest
	cfg.Sarama.Metadata.RefreshFrequency = 500 * time.Millisecond
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	r := startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
	require.Eventually(t, func() bool { return committedOffset(c, group, topic, 0) >= 0 }, 30*time.Second, 20*time.Millisecond)
	c.produceHashed(idless(topic, 0, 3))
	waitEffectsByN(t, db, 3)

	moveCoordinator(t, c, group)
	c.produceHashed(idless(topic, 10, 2)) // still consumed: the group follows its coordinator
	waitEffectsByN(t, db, 5)

	c.addPartitionWithRecords(topic)
	waitEffectsByN(t, db, 10)
	require.NoError(t, r.stop())
	want := map[int]int{0: 1, 1: 1, 2: 1, 10: 1, 11: 1, 100: 1, 101: 1, 102: 1, 103: 1, 104: 1}
	require.Equal(t, want, effectsByN(t, db), "the new partition's records handled once, from its first")
}

// Partition leaders and the group's coordinator move between brokers again
// and again while a stream with poison records is consumed (a rolling
// restart does both): every event has its effect once, every poison
// record is dead-lettered once.
func TestLeadersAndCoordinatorMovingMidStream(t *testing.T) {
	c := newCluster(t, kfake.NumBrokers(3))
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 4)
	db := effectsDB(t)
	src, err := Open(t.Context(), c.config(group, topic))
	require.NoError(t, err)
	r := startConsumer(t, db, src, consumerConfig("svc"), recordEffect)

	const events, poison = 400, 8
	var msgs []*sarama.ProducerMessage
	for i := range events {
		msgs = append(msgs, msg(topic, int32(i%4), fmt.Sprintf(`{"n":%d}`, i)))
		if i%(events/poison) == 0 {
			msgs = append(msgs, msg(topic, int32(i%4), "not json"))
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < len(msgs); i += 20 {
			c.produce(msgs[i:min(i+20, len(msgs))]...)
			c.kf.ShufflePartitionLeaders()
			if i%60 == 0 {
				c.kf.RehashCoordinators()
			}
		}
	}()
	<-done
	waitEffectsByN(t, db, events)
	require.Eventually(t, func() bool {
		st := r.c.Stats()
		return st.DeadLettered >= poison
	}, 60*time.Second, 20*time.Millisecond, "every poison record dead-lettered")
	require.NoError(t, r.stop())
	counts := effectsByN(t, db)
	require.Len(t, counts, events)
	for n, k := range counts {
		require.Equal(t, 1, k, "event %d", n)
	}
	require.Len(t, c.readAll(topic+".dlq"), poison, "each poison record dead-lettered once")
}

// The broker that was the group's coordinator leaves the cluster (a
// broker decommissioned, or down for longer than a restart): the source's
// client still holds it as the coordinator, and its questions failed on a
// connection refused until the client's metadata forgot the broker (up to
// Metadata.RefreshFrequency, 10 minutes by default).
func TestCommittedOffsetsAskedAfterTheCoordinatorLeft(t *testing.T) {
	c := newCluster(t, kfake.NumBrokers(3))
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	src := c.open(c.config(group, topic))
	defer src.Close()
	c.produce(msg(topic, 0, `{"n":1}`))
	require.NoError(t, receive(t, src).Ack(t.Context())) // the group exists
	_, err := src.fetchCommitted(map[string][]int32{topic: {0}})
	require.NoError(t, err, "the coordinator known")

	require.NoError(t, c.kf.RemoveNode(c.kf.CoordinatorFor(group)))
	resp, err := src.fetchCommitted(map[string][]int32{topic: {0}})
	require.NoError(t, err, "asked again of the new coordinator")
	require.NotNil(t, resp.GetBlock(topic, 0))
}

// A member closed after the group's coordinator moved, before a heartbeat
// told it so (a deploy during a rolling restart of the brokers), sent its
// LeaveGroup to the broker its client still took for the coordinator,
// which refused it ("not coordinated by this broker"): Run returned that
// error, and the group kept the member, and the partitions it held, until
// its session timed out. The source finds the coordinator again before it
// leaves.
func TestCloseAfterTheCoordinatorMovedLeavesTheGroup(t *testing.T) {
	c := newCluster(t, kfake.NumBrokers(3))
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 2)
	db := effectsDB(t)
	cfg := c.config(group, topic)
	// No heartbeat between the move and the close: the member's client
	// cannot have learnt of the move.
	cfg.HeartbeatInterval, cfg.SessionTimeout = 5*time.Second, 20*time.Second
	open := func() *runningConsumer {
		src, err := Open(t.Context(), cfg)
		require.NoError(t, err)
		return startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
	}
	a, b := open(), open()
	require.Eventually(t, func() bool { return len(groupMembers(t, c, group)) == 2 }, 30*time.Second, 20*time.Millisecond)
	c.produceHashed(idless(topic, 0, 4))
	waitEffectsByN(t, db, 4)

	moveCoordinator(t, c, group)
	require.NoError(t, a.stop(), "the member leaves the group at its new coordinator")
	require.Len(t, groupMembers(t, c, group), 1, "the group let the closed member go at once, not at its session timeout")
	require.NoError(t, b.stop())
}

// groupMembers returns the member ids of group, as its coordinator
// describes it.
func groupMembers(t *testing.T, c *cluster, group string) []string {
	t.Helper()
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(t, err)
	defer func() { _ = admin.Close() }()
	groups, err := admin.DescribeConsumerGroups([]string{group})
	require.NoError(t, err)
	require.Len(t, groups, 1)
	var ids []string
	for id := range groups[0].Members {
		ids = append(ids, id)
	}
	return ids
}

// moveCoordinator has kfake move group's coordinator to another broker, as
// a rolling restart moves the leaders of __consumer_offsets.
func moveCoordinator(t *testing.T, c *cluster, group string) {
	t.Helper()
	before := c.kf.CoordinatorFor(group)
	for range 20 {
		c.kf.RehashCoordinators()
		if c.kf.CoordinatorFor(group) != before {
			return
		}
	}
	require.NotEqual(t, before, c.kf.CoordinatorFor(group), "the coordinator moved")
}
