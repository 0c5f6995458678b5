package kafka

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceco/once/internal/netcut"
)

// With StartNewest, a partition that had no record while the group first
// held it keeps the position the group started at: a record produced to it
// while the group's member was stopped is read by the next member, not
// skipped as if the group had never joined.
func TestStartNewestKeepsTheStartOfAnIdlePartition(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) { testStartNewestKeepsTheStart(t, kind) })
}

func testStartNewestKeepsTheStart(t *testing.T, kind brokerKind) {
	c := newClusterOf(t, kind)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 2)
	cfg := c.config(group, topic)
	cfg.InitialOffset = StartNewest

	// Partition 0 gets records until a member receives one (the group
	// then holds both partitions); partition 1 gets none.
	ackOneAndClose(t, c, c.open(cfg), topic)

	c.produce(msg(topic, 1, "b")) // produced after the group joined
	b := c.open(cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	d, err := b.Receive(ctx)
	require.NoError(t, err, "the record produced to the idle partition while no member ran was skipped")
	assert.Equal(t, "b", string(d.Message().Value))
	assert.Equal(t, int32(1), d.Message().Partition)
}

// The start of an idle partition is read from the group's coordinator on
// the dead-letter client's connection to it, which stays broken once cut
// (a sarama Broker does not reconnect by itself): after any connection cut
// every session's marking failed ("EOF", a warning), and a record produced
// to the idle partition while no member ran was skipped. The marking opens
// the connection again.
func TestStartNewestKeepsTheStartAfterConnectionsWereCut(t *testing.T) {
	var ln *netcut.Listener
	c := newCluster(t, kfake.ListenFn(func(network, addr string) (net.Listener, error) {
		inner, err := net.Listen(network, addr)
		if err != nil {
			return nil, err
		}
		ln = &netcut.Listener{Listener: inner}
		return ln, nil
	}))
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 2)
	cfg := c.config(group, topic)
	cfg.InitialOffset = StartNewest

	a := c.open(cfg)
	require.Positive(t, ln.Cut(), "Open's connections are cut before the group is joined")
	ackOneAndClose(t, c, a, topic)

	c.produce(msg(topic, 1, "b")) // produced after the group joined
	b := c.open(cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	d, err := b.Receive(ctx)
	require.NoError(t, err, "the record produced to the idle partition while no member ran was skipped")
	assert.Equal(t, "b", string(d.Message().Value))
	assert.Equal(t, int32(1), d.Message().Partition)
}

// With StartNewest, a group's first start is the partition's last stable
// offset, as a read-committed Java consumer's (auto.offset.reset=latest):
// the partition's end was asked without the isolation level, so the group
// started at the high-water mark, past the records of a transaction still
// open, and skipped them once the transaction committed.
func TestStartNewestStartsBeforeAnOpenTransaction(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) { testStartNewestStartsBeforeAnOpenTransaction(t, kind) })
}

func testStartNewestStartsBeforeAnOpenTransaction(t *testing.T, kind brokerKind) {
	c := newClusterOf(t, kind)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	ctx := t.Context()
	tp := openTransaction(t, c, topic, 0)

	cfg := c.config(group, topic)
	cfg.InitialOffset = StartNewest
	src := c.open(cfg)
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	got := receiveAside(rctx, src) // joins the group
	// The group's start is committed once the member holds the partition.
	start := func() int64 { return committedOffset(c, group, topic, 0) }
	require.Eventually(t, func() bool { return start() >= 0 }, 15*time.Second, 20*time.Millisecond)
	assert.Equal(t, int64(0), start(), "the group starts at the open transaction's first record")

	require.NoError(t, tp.EndTransaction(ctx, kgo.TryCommit))
	r := <-got
	require.NoError(t, r.err, "the record of the transaction open when the group started was skipped")
	assert.Equal(t, "in-txn", string(r.d.Message().Value))
}

// With StartNewest, a partition whose start the session's Setup could not
// mark (the cluster did not answer its question) starts where the
// partition consumer asks: that was the high-water mark, past the records
// of a transaction open at the start, which were skipped once it
// committed. It is the last stable offset too, as on the first start.
func TestStartNewestStartsBeforeAnOpenTransactionWhenSetupCannotMarkIt(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	ctx := t.Context()
	tp := openTransaction(t, c, topic, 0)

	// The partition's end, read committed, is refused to Setup (its
	// question and the one retry); once the partition consumer asked for
	// the partition's start (the oldest offset, after the newest), the
	// claim's start is chosen.
	var refused atomic.Int32
	chosen := make(chan struct{})
	var chosenOnce sync.Once
	c.kf.ControlKey(kmsg.ListOffsets.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.kf.KeepControl()
		lreq := req.(*kmsg.ListOffsetsRequest)
		for _, rt := range lreq.Topics {
			for _, rp := range rt.Partitions {
				if rt.Topic == topic && rp.Timestamp == sarama.OffsetOldest {
					chosenOnce.Do(func() { close(chosen) })
				}
			}
		}
		if lreq.IsolationLevel != 1 || refused.Load() >= 2 {
			return nil, nil, false
		}
		refused.Add(1)
		resp := lreq.ResponseKind().(*kmsg.ListOffsetsResponse)
		resp.Version = lreq.Version
		for _, rt := range lreq.Topics {
			st := kmsg.NewListOffsetsResponseTopic()
			st.Topic = rt.Topic
			for _, rp := range rt.Partitions {
				sp := kmsg.NewListOffsetsResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = kerr.UnknownServerError.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})

	cfg := c.config(group, topic)
	cfg.InitialOffset = StartNewest
	src := c.open(cfg)
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	got := receiveAside(rctx, src) // joins the group
	select {
	case <-chosen:
	case <-rctx.Done():
		t.Fatal("the partition consumer never asked for the partition's start")
	}
	require.Equal(t, int32(2), refused.Load(), "Setup's question was refused")

	require.NoError(t, tp.EndTransaction(ctx, kgo.TryCommit))
	r := <-got
	require.NoError(t, r.err, "the record of the transaction open when the partition was claimed was skipped")
	assert.Equal(t, "in-txn", string(r.d.Message().Value))
}

// With StartNewest, a partition that a cooperative rebalance adds (here:
// a partition added to the topic) gets no session start to mark: sarama
// starts it where it resolves the newest offset. That was the high-water
// mark, past the records of a transaction open when the partition was
// claimed, which were skipped once it committed. It is the last stable
// offset.
func TestStartNewestStartsBeforeAnOpenTransactionOnAPartitionAddedCooperatively(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	ctx := t.Context()
	cfg := c.config(group, topic)
	cfg.InitialOffset = StartNewest
	cfg.Sarama.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategyCooperativeSticky()}
	cfg.Sarama.Metadata.RefreshFrequency = 100 * time.Millisecond // the leader's check of the partition count
	src := c.open(cfg)
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	got := receiveAside(rctx, src) // joins the group
	// The start of partition 0 is committed once the member holds it.
	start := func() int64 { return committedOffset(c, group, topic, 0) }
	require.Eventually(t, func() bool { return start() >= 0 }, 20*time.Second, 20*time.Millisecond, "the member holds partition 0")

	// The rebalance that adds partition 1 waits until its transaction is
	// open; the claim's start is chosen once the partition consumer asked
	// for the partition's oldest offset (after the newest).
	opened := make(chan struct{})
	c.kf.ControlKey(kmsg.JoinGroup.Int16(), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.kf.KeepControl()
		c.kf.SleepControl(func() { <-opened })
		return nil, nil, false
	})
	chosen := make(chan struct{})
	var chosenOnce sync.Once
	c.kf.ControlKey(kmsg.ListOffsets.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.kf.KeepControl()
		for _, rt := range req.(*kmsg.ListOffsetsRequest).Topics {
			for _, rp := range rt.Partitions {
				if rt.Topic == topic && rp.Partition == 1 && rp.Timestamp == sarama.OffsetOldest {
					chosenOnce.Do(func() { close(chosen) })
				}
			}
		}
		return nil, nil, false
	})
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(t, err)
	require.NoError(t, admin.CreatePartitions(topic, 2, nil, false))
	require.NoError(t, admin.Close())
	tp := openTransaction(t, c, topic, 1)
	close(opened)
	select {
	case <-chosen:
	case <-rctx.Done():
		t.Fatal("partition 1 was never claimed")
	}

	require.NoError(t, tp.EndTransaction(ctx, kgo.TryCommit))
	r := <-got
	require.NoError(t, r.err, "the record of the transaction open when the partition was claimed was skipped")
	assert.Equal(t, "in-txn", string(r.d.Message().Value))
	assert.Equal(t, int32(1), r.d.Message().Partition)
}

// openTransaction begins a transaction that writes one record,
// "in-txn", to topic's partition and leaves it open; the test ends it.
func openTransaction(t *testing.T, c *cluster, topic string, partition int32) *kgo.Client {
	t.Helper()
	tp, err := kgo.NewClient(kgo.SeedBrokers(c.addrs...), kgo.TransactionalID(uniq("txn")),
		kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	t.Cleanup(tp.Close)
	require.NoError(t, tp.BeginTransaction())
	rec := &kgo.Record{Topic: topic, Partition: partition, Value: []byte("in-txn")}
	require.NoError(t, tp.ProduceSync(t.Context(), rec).FirstErr())
	return tp
}

// receivedAside is what a Receive run aside returned.
type receivedAside struct {
	d   *delivery
	err error
}

// receiveAside runs one src.Receive on a goroutine (which joins the
// group) and sends its result.
func receiveAside(ctx context.Context, src *Source) <-chan receivedAside {
	got := make(chan receivedAside, 1)
	go func() {
		d, err := src.Receive(ctx)
		r := receivedAside{err: err}
		if err == nil {
			r.d = d.(*delivery)
		}
		got <- r
	}()
	return got
}

// committedOffset is the offset group has committed for topic's
// partition, -1 when none is (or the cluster did not answer).
func committedOffset(c *cluster, group, topic string, partition int32) int64 {
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	if err != nil {
		return -1
	}
	defer admin.Close()
	resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: {partition}})
	if err != nil || resp.GetBlock(topic, partition) == nil {
		return -1
	}
	return resp.GetBlock(topic, partition).Offset
}

// ackOneAndClose produces records to topic's partition 0 until a
// receives one (its group has joined and committed its starts by then),
// acks that one and closes a.
func ackOneAndClose(t *testing.T, c *cluster, a *Source, topic string) {
	t.Helper()
	var got *delivery
	for got == nil {
		c.produce(msg(topic, 0, "a"))
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		d, err := a.Receive(ctx)
		cancel()
		if err == nil {
			got = d.(*delivery)
		}
	}
	require.NoError(t, got.Ack(context.Background()))
	require.NoError(t, a.Close())
}

// With StartNewest, a group new to a topic starts every partition at its
// end, also when its first members set up their claims at once: each
// member's Setup marks and commits the start of its own partitions, and a
// member whose Setup asked for the group's committed offsets after another
// member had committed its starts took its own partitions for partitions
// added to a topic the group already reads, and read them from their first
// record: the records StartNewest leaves behind, handled. Here the second
// member's question waits for the first member's commit, as a member
// slower by a few milliseconds would.
func TestStartNewestGroupWhoseMembersStartTogetherStartsAtTheEnd(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 2)
	c.produce(msg(topic, 0, "old"), msg(topic, 1, "old"))

	// Both members in the group's first generation that sets up claims:
	// the first member's first SyncGroup waits until the second has
	// joined, and the group rebalances again with both.
	joinedBoth := func() bool {
		g := c.kf.GroupInfo(group)
		return g != nil && g.State == "PreparingRebalance" && len(g.Members) == 2
	}
	startsCommitted := func(n int) func() bool {
		return func() bool {
			g := c.kf.GroupInfo(group)
			if g == nil {
				return false
			}
			k := 0
			for _, cm := range g.Commits[topic] {
				if cm.Offset >= 0 {
					k++
				}
			}
			return k >= n
		}
	}
	waitFor := func(cond func() bool) {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for !cond() {
			select {
			case <-tick.C:
			case <-t.Context().Done():
				return
			}
		}
	}
	var synced atomic.Bool
	c.kf.ControlKey(kmsg.SyncGroup.Int16(), func(kmsg.Request) (kmsg.Response, error, bool) {
		if synced.CompareAndSwap(false, true) {
			c.kf.SleepControl(func() { waitFor(joinedBoth) })
		} else {
			c.kf.KeepControl()
		}
		return nil, nil, false
	})
	// The second question for the committed offsets of the topic's two
	// partitions (a Setup's) waits until the first member committed its
	// start.
	var asked atomic.Int32
	c.kf.ControlKey(kmsg.OffsetFetch.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.kf.KeepControl()
		if offsetFetchPartitions(req.(*kmsg.OffsetFetchRequest), topic) < 2 || asked.Add(1) != 2 {
			return nil, nil, false
		}
		c.kf.SleepControl(func() { waitFor(startsCommitted(1)) })
		return nil, nil, false
	})

	cfg := c.config(group, topic)
	cfg.InitialOffset = StartNewest
	// The first member joins again at once after its refused SyncGroup,
	// within its session.
	cfg.Sarama.Consumer.Group.Rebalance.Retry.Backoff = 50 * time.Millisecond
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	got := make(chan *delivery, 8)
	// Both opened before either joins the group (at its first Receive),
	// so that the first waits for the second only for a moment.
	for _, src := range []*Source{c.open(cfg), c.open(cfg)} {
		go func() {
			for {
				d, err := src.Receive(ctx)
				if err != nil {
					return
				}
				got <- d.(*delivery)
			}
		}()
	}
	// Both starts committed: the group holds both partitions.
	waitFor(startsCommitted(2))
	require.Equal(t, int32(2), asked.Load(), "both members asked for the committed offsets in their Setup")

	c.produce(msg(topic, 0, "new"), msg(topic, 1, "new"))
	for range 2 {
		select {
		case d := <-got:
			require.Equal(t, "new", string(d.Message().Value),
				"a record produced before the group started was handled (partition %d, offset %d)", d.Message().Partition, d.Message().Offset)
			require.NoError(t, d.Ack(ctx))
		case <-ctx.Done():
			t.Fatal("the records produced after the group started were not received")
		}
	}
}

// offsetFetchPartitions returns how many partitions of topic req asks
// about.
func offsetFetchPartitions(req *kmsg.OffsetFetchRequest, topic string) int {
	n := 0
	for _, rt := range req.Topics {
		if rt.Topic == topic {
			n += len(rt.Partitions)
		}
	}
	for _, g := range req.Groups {
		for _, rt := range g.Topics {
			if rt.Topic == topic {
				n += len(rt.Partitions)
			}
		}
	}
	return n
}
