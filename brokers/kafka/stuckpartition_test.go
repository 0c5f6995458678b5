package kafka

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// TestStuckPartitionDoesNotStopTheOthers: a partition whose first record
// is stuck (a handler that does not return, a RetryAfter, a dead-letter
// topic the cluster refuses) waits at it, with a backlog behind it; the
// consumer's other partitions go on.
func TestStuckPartitionDoesNotStopTheOthers(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 2)
	const backlog, others = 600, 5
	record := func(partition int32, id string, n int) *sarama.ProducerMessage {
		return &sarama.ProducerMessage{Topic: topic, Partition: partition, Value: sarama.StringEncoder(fmt.Sprintf(`{"n":%d}`, n)),
			Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(id)}}}
	}
	var msgs []*sarama.ProducerMessage
	for i := range backlog {
		msgs = append(msgs, record(0, fmt.Sprintf("p0-%d", i), i))
	}
	c.produce(msgs...)

	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	src := c.open(c.config(group, topic))
	release := make(chan struct{})
	cfg := consumerConfig("orders-svc")
	cfg.HandlerTimeout = consumer.NoHandlerTimeout
	cfg.Concurrency = 2
	cfg.Batch.Size = 1
	r := startConsumer(t, db, src, cfg, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
		if ev.ID == "p0-0" {
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return recordEffect(ctx, tx, ev)
	})
	// The stuck partition's backlog fills what the consumer may hold
	// (ReceiveBuffer: 256 with these settings).
	require.Eventually(t, func() bool { return r.c.Stats().Received >= 256 }, 30*time.Second, 5*time.Millisecond)

	msgs = msgs[:0]
	for i := range others {
		msgs = append(msgs, record(1, fmt.Sprintf("p1-%d", i), i))
	}
	c.produce(msgs...)
	require.Eventually(t, func() bool {
		got := effectCounts(t, db)
		for i := range others {
			if got[fmt.Sprintf("p1-%d", i)] != 1 {
				return false
			}
		}
		return true
	}, 20*time.Second, 20*time.Millisecond, "the other partition's records wait behind the stuck one's backlog")

	close(release)
	waitEffects(t, db, backlog+others, 60*time.Second)
	require.NoError(t, r.stop())
	got := effectCounts(t, db)
	require.Len(t, got, backlog+others)
	for id, n := range got {
		require.Equal(t, 1, n, "double effect for %s", id)
	}
}
