package kafka

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

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

	a := c.open(cfg)
	// Partition 0 gets records until a receives one (the group then holds
	// both partitions); partition 1 gets none.
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
	tp, err := kgo.NewClient(kgo.SeedBrokers(c.addrs...), kgo.TransactionalID(uniq("txn")),
		kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	defer tp.Close()
	require.NoError(t, tp.BeginTransaction())
	require.NoError(t, tp.ProduceSync(ctx, &kgo.Record{Topic: topic, Partition: 0, Value: []byte("in-txn")}).FirstErr())

	cfg := c.config(group, topic)
	cfg.InitialOffset = StartNewest
	src := c.open(cfg)
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	type received struct {
		d   *delivery
		err error
	}
	got := make(chan received, 1)
	go func() { // joins the group
		d, err := src.Receive(rctx)
		r := received{err: err}
		if err == nil {
			r.d = d.(*delivery)
		}
		got <- r
	}()
	// The group's start is committed once the member holds the partition.
	start := func() int64 {
		admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
		if err != nil {
			return -1
		}
		defer admin.Close()
		resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: {0}})
		if err != nil || resp.GetBlock(topic, 0) == nil {
			return -1
		}
		return resp.GetBlock(topic, 0).Offset
	}
	require.Eventually(t, func() bool { return start() >= 0 }, 15*time.Second, 20*time.Millisecond)
	assert.Equal(t, int64(0), start(), "the group starts at the open transaction's first record")

	require.NoError(t, tp.EndTransaction(ctx, kgo.TryCommit))
	r := <-got
	require.NoError(t, r.err, "the record of the transaction open when the group started was skipped")
	assert.Equal(t, "in-txn", string(r.d.Message().Value))
}
