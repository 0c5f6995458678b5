package kafka

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

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
