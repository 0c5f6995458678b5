package kafka

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A member fenced by another group under its consumer name holds its
// claim, idle, until its session ends. It kept fetching the partition
// meanwhile, reading and dropping every record produced to it, for as
// long as the session lasted; its fetching is paused instead, so that it
// drops at most what a fetch in flight brought.
func TestOffsetsInDatabaseFencedClaimStopsFetching(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	db, _, _ := migratedSchema(t)
	c.produce(msg(topic, 0, `{"n":0}`))
	groupA := uniq("ga")
	srcA, err := Open(t.Context(), c.dbOffsetsConfig(groupA, topic))
	require.NoError(t, err)
	a := startConsumer(t, db, srcA, consumerConfig("svc"), recordEffect)
	waitEffectsByN(t, db, 1)
	owner := func() (group string, generation int32) {
		err := db.QueryRow(context.Background(), `SELECT kafka_group, generation FROM processed_events_offsets WHERE consumer = 'svc'`).Scan(&group, &generation)
		if err != nil {
			return "", -1
		}
		return group, generation
	}
	_, first := owner()

	groupB := uniq("gb")
	srcB, err := Open(t.Context(), c.dbOffsetsConfig(groupB, topic))
	require.NoError(t, err)
	b := startConsumer(t, db, srcB, consumerConfig("svc"), recordEffect)
	require.Eventually(t, func() bool { g, _ := owner(); return g == groupB }, 30*time.Second, 10*time.Millisecond,
		"B took the partition over")
	// A is fenced at its next record.
	c.produce(msg(topic, 0, `{"n":1}`))
	require.Eventually(t, func() bool { return srcA.heldFenced.Load() == 1 }, 30*time.Second, 10*time.Millisecond,
		"A, fenced by B's group, holds its claim")
	waitEffectsByN(t, db, 2)

	const n = 50
	for i := 2; i < 2+n; i++ {
		c.produce(msg(topic, 0, fmt.Sprintf(`{"n":%d}`, i)))
		waitEffectsByN(t, db, i+1)
	}
	require.Equal(t, int32(1), srcA.heldFenced.Load(), "A still holds its claim")
	assert.LessOrEqual(t, srcA.fencedDropped.Load(), int64(5),
		"A fetched and dropped the records produced while it held its fenced claim")

	// A's group rebalances (a member joins, then leaves): A's held claim
	// ends, and the partition, claimed by A again, is fetched again.
	srcA2, err := Open(t.Context(), c.dbOffsetsConfig(groupA, topic))
	require.NoError(t, err)
	a2 := startConsumer(t, db, srcA2, consumerConfig("svc"), recordEffect)
	require.Eventually(t, func() bool { return srcA.heldFenced.Load() == 0 }, 30*time.Second, 10*time.Millisecond,
		"A's fenced claim ends with its session")
	require.NoError(t, a2.stop())
	require.Eventually(t, func() bool { g, gen := owner(); return g == groupA && gen >= first+2 }, 30*time.Second, 10*time.Millisecond,
		"A, alone in its group again, took the partition over")
	// B, fenced in turn, cannot record any record now: A handles it.
	c.produce(msg(topic, 0, fmt.Sprintf(`{"n":%d}`, n+2)))
	waitEffectsByN(t, db, n+3)
	require.NoError(t, b.stop())
	require.NoError(t, a.stop())
	requireEachOnce(t, db, n+3)
}
