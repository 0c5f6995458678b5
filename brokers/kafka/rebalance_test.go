package kafka

import (
	"context"
	"fmt"
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
	// open starts a member; abandoned counts the deliveries it left
	// unacked (a revoke that outlasted RevokeTimeout on a loaded
	// machine): received, but neither handled nor duplicates, and
	// delivered again to whichever member holds their partition next.
	open := func(abandoned *atomic.Uint64) *runningConsumer {
		scfg := c.config(group, topic)
		scfg.Sarama.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{strategy}
		scfg.OffsetsInDatabase = offsetsInDB
		src, err := Open(t.Context(), scfg)
		require.NoError(t, err)
		cfg := consumerConfig("orders-svc")
		cfg.Hooks.OnOutcome = func(_ context.Context, o consumer.Outcome) {
			if o.Result == consumer.ResultAbandoned {
				abandoned.Add(1)
			}
		}
		return startConsumer(t, db, src, cfg, slow)
	}

	var aAbandoned, bAbandoned atomic.Uint64
	a := open(&aAbandoned)
	waitEffects(t, db, 200, 30*time.Second)
	b := open(&bAbandoned) // joins: partitions move from a to b
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
		return st.Received == st.Handled+st.Duplicates+bAbandoned.Load()
	}, 30*time.Second, 10*time.Millisecond, "b settles everything it received")
	require.NoError(t, b.stop())

	requireExactlyOnce(t, db, "ev", n)
	sa, sb := a.c.Stats(), b.c.Stats()
	assert.Equal(t, uint64(n), sa.Handled+sb.Handled, "one committed transaction per event across both members")
	assert.Positive(t, sa.Handled)
	assert.Positive(t, sb.Handled)
	assert.Zero(t, sa.DeadLettered+sb.DeadLettered)
	assert.Equal(t, sa.Received, sa.Handled+sa.Duplicates+aAbandoned.Load(), "a settled or abandoned everything it received")
	t.Logf("%d events; a: %+v, %d abandoned; b: %+v, %d abandoned", n, sa, aAbandoned.Load(), sb, bAbandoned.Load())

	// After both stopped cleanly, the group's offsets are the ends of the
	// partitions: nothing will be delivered again.
	got := c.committed(group, topic, partitions)
	for p := range int32(partitions) {
		assert.Equal(t, hwm(t, c, topic, p), got[p], "partition %d", p)
	}
}

// With the cooperative protocol the session goes on while a partition is
// revoked: a revoked claim paused at Config.MaxPendingPerPartition still
// lets its unsettled deliveries go after RevokeTimeout, instead of holding
// the partition until the rebalance times out.
func TestCooperativeRevokeOfPausedClaimKeepsRevokeTimeout(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 2)
	c.produce(msg(topic, 0, "a0"), msg(topic, 0, "a1"), msg(topic, 1, "b0"), msg(topic, 1, "b1"))
	cfg := c.config(group, topic)
	cfg.Sarama.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategyCooperativeSticky()}
	cfg.MaxPendingPerPartition = 1
	cfg.RevokeTimeout = 300 * time.Millisecond
	a := c.open(cfg)
	held := receiveN(t, a, 2) // offset 0 of each partition; both claims then wait for room
	require.Eventually(t, func() bool { return a.claimsWaitingForRoom() == 2 }, 10*time.Second, 5*time.Millisecond)

	b := c.open(cfg)
	bctx, bcancel := context.WithCancel(context.Background())
	defer bcancel()
	go func() {
		for {
			d, err := b.Receive(bctx)
			if err != nil {
				return
			}
			_ = d.Ack(bctx)
		}
	}()

	// One partition moves to b: its delivery held by a is abandoned within
	// RevokeTimeout (plus the rebalance), far below RebalanceTimeout (8 s).
	start := time.Now()
	require.Eventually(t, func() bool {
		return held[0].Context().Err() != nil || held[1].Context().Err() != nil
	}, 4*time.Second, 10*time.Millisecond, "the revoked claim's delivery was not abandoned within RevokeTimeout")
	t.Logf("revoked delivery abandoned after %v", time.Since(start).Round(time.Millisecond))
}

// With the cooperative protocol, a partition revoked while the consumer
// takes no more records (its receive buffer full behind a stuck record, or
// the database down) goes to its new owner after RevokeTimeout, instead of
// when the rebalance times out. Each partition holds more records than
// sarama buffers and the claim reads ahead.
func TestCooperativeRevokeWhileNotReceivingKeepsRevokeTimeout(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 2)
	var msgs []*sarama.ProducerMessage
	for i := range 3000 {
		msgs = append(msgs, msg(topic, int32(i%2), fmt.Sprint(i)))
	}
	c.produce(msgs...)
	cfg := c.config(group, topic)
	cfg.Sarama.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategyCooperativeSticky()}
	cfg.RevokeTimeout = 300 * time.Millisecond
	a := c.open(cfg)
	receive(t, a) // held unacked; a receives nothing more: both claims wait to hand a record out

	b := c.open(cfg)
	bctx, bcancel := context.WithCancel(context.Background())
	defer bcancel()
	bGot := make(chan *delivery, 10)
	go func() {
		for {
			d, err := b.Receive(bctx)
			if err != nil {
				return
			}
			bGot <- d.(*delivery)
		}
	}()

	// One partition moves to b within RevokeTimeout (plus the rebalance),
	// far below RebalanceTimeout (8 s).
	start := time.Now()
	select {
	case d := <-bGot:
		t.Logf("b received %s/%d after %v", d.Message().Topic, d.Message().Partition, time.Since(start).Round(time.Millisecond))
	case <-time.After(4 * time.Second):
		t.Fatal("the revoked partition did not reach its new owner within RevokeTimeout")
	}
}

// sarama's sticky strategies keep the state of the group they plan for
// (the movements of a plan; cooperative-sticky the member's generation) and
// must not be shared between consumer-group clients. Sources opened from
// one base configuration get instances of their own: sharing one, two
// Sources whose groups planned at the same time wrote the same maps (a data
// race the race detector reports, and Go's fatal "concurrent map writes"),
// and each sent the other's generation in its subscription.
func TestSourcesFromOneBaseDoNotShareStickyStrategies(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	base := saramaConfig()
	base.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{
		sarama.NewBalanceStrategyCooperativeSticky(), sarama.NewBalanceStrategySticky(), sarama.NewBalanceStrategyRange()}
	shared := append([]sarama.BalanceStrategy(nil), base.Consumer.Group.Rebalance.GroupStrategies...)
	var got [][]sarama.BalanceStrategy
	for _, group := range []string{uniq("g"), uniq("g")} {
		cfg := c.config(group, topic)
		cfg.Sarama = base
		s := c.open(cfg)
		got = append(got, s.groupClient.Config().Consumer.Group.Rebalance.GroupStrategies)
	}
	assert.Equal(t, shared, base.Consumer.Group.Rebalance.GroupStrategies, "the base configuration is not modified")
	for i, st := range shared[:2] {
		assert.Equal(t, st.Name(), got[0][i].Name())
		assert.NotSame(t, st, got[0][i], "%s: the base's instance is used by a Source", st.Name())
		assert.NotSame(t, got[0][i], got[1][i], "%s: two Sources share one instance", st.Name())
	}
	assert.Equal(t, sarama.RangeBalanceStrategyName, got[0][2].Name(), "a stateless strategy is kept")
}
