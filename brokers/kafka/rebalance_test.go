package kafka

import (
	"context"
	"testing"
	"time"

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
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	const partitions, n = 4, 2000
	c.createTopic(topic, partitions)
	c.produceHashed(events(topic, "ev", 0, n))
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)

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
		src, err := NewSource(c.config(group, topic))
		require.NoError(t, err)
		return startConsumer(t, db, src, cfg, slow)
	}

	a := open()
	waitEffects(t, db, 200, 30*time.Second)
	b := open() // joins: every partition is revoked and reassigned
	require.Eventually(t, func() bool { return b.c.Stats().Handled > 0 }, 30*time.Second, 10*time.Millisecond,
		"the second member got partitions")
	require.Less(t, len(effectCounts(t, db)), n, "b joined mid-stream")
	require.NoError(t, a.stop()) // leaves: its partitions go to b
	require.Less(t, len(effectCounts(t, db)), n, "a left mid-stream")
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
	t.Logf("a: %+v; b: %+v", sa, sb)

	// After both stopped cleanly, the group's offsets are the ends of the
	// partitions: nothing will be delivered again.
	got := c.committed(group, topic, partitions)
	for p := range int32(partitions) {
		assert.Equal(t, hwm(t, c, topic, p), got[p], "partition %d", p)
	}
}
