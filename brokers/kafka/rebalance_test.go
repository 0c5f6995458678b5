package kafka

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// A second member joins mid-stream, then the first leaves mid-stream, while
// a slow handler keeps deliveries in flight on every partition: every
// event's effect is there exactly once, and nothing is lost.
func TestRebalanceMidStreamExactlyOnce(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		t.Run("eager", func(t *testing.T) { testRebalance(t, kind, sarama.NewBalanceStrategyRange(), false) })
		t.Run("cooperative-sticky", func(t *testing.T) { testRebalance(t, kind, sarama.NewBalanceStrategyCooperativeSticky(), false) })
		// Each take-over in the database fences the previous owner.
		t.Run("eager-offsets-in-database", func(t *testing.T) { testRebalance(t, kind, sarama.NewBalanceStrategyRange(), true) })
	})
}

func testRebalance(t *testing.T, kind brokerKind, strategy sarama.BalanceStrategy, offsetsInDB bool) {
	c := newClusterOf(t, kind)
	topic, group := uniq("orders"), uniq("g")
	const partitions = 4
	c.createTopic(topic, partitions)
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)

	// A producer writes 10 events every 10 ms (about what the consumer
	// handles) until told to stop, so that members join and leave
	// mid-stream.
	var produced atomic.Int64
	stopProducing := make(chan struct{})
	producerDone := make(chan error, 1)
	go func() {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stopProducing:
				producerDone <- nil
				return
			case <-tick.C:
			}
			from := int(produced.Load())
			if err := produceHashed(c.addrs, events(topic, "ev", from, 10)); err != nil {
				producerDone <- err
				return
			}
			produced.Add(10)
		}
	}()

	slow := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
		select { // work that takes a while, as a real handler does
		case <-time.After(3 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
		return recordEffect(ctx, tx, ev)
	}
	cfg := consumerConfig("orders-svc")
	open := func() *runningConsumer {
		scfg := c.config(group, topic)
		scfg.Sarama.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{strategy}
		scfg.OffsetsInDatabase = offsetsInDB
		src, err := Open(t.Context(), scfg)
		require.NoError(t, err)
		return startConsumer(t, db, src, cfg, slow)
	}

	a := open()
	waitEffects(t, db, 200, 30*time.Second)
	b := open() // joins: partitions move from a to b
	require.Eventually(t, func() bool { return b.c.Stats().Handled > 0 }, 30*time.Second, 10*time.Millisecond,
		"the second member got partitions")
	require.NoError(t, a.stop()) // leaves: its partitions go to b
	bHandled := b.c.Stats().Handled
	require.Eventually(t, func() bool { return b.c.Stats().Handled >= bHandled+100 }, 30*time.Second, 10*time.Millisecond,
		"b goes on alone")
	close(stopProducing)
	require.NoError(t, <-producerDone)
	n := int(produced.Load())
	waitEffects(t, db, n, 60*time.Second)
	require.Eventually(t, func() bool {
		st := b.c.Stats()
		return st.Received == st.Handled+st.Duplicates
	}, 30*time.Second, 10*time.Millisecond, "b settles everything it received")
	require.NoError(t, b.stop())

	requireExactlyOnce(t, db, "ev", n)
	sa, sb := a.c.Stats(), b.c.Stats()
	assert.Equal(t, uint64(n), sa.Handled+sb.Handled, "one committed transaction per event across both members")
	assert.Positive(t, sa.Handled)
	assert.Positive(t, sb.Handled)
	assert.Zero(t, sa.DeadLettered+sb.DeadLettered)
	t.Logf("%d events; a: %+v; b: %+v", n, sa, sb)

	// After both stopped cleanly, the group's offsets are the ends of the
	// partitions: nothing will be delivered again.
	got := c.committed(group, topic, partitions)
	for p := range int32(partitions) {
		assert.Equal(t, hwm(t, c, topic, p), got[p], "partition %d", p)
	}
}
