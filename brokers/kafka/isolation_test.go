package kafka

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceco/once/internal/pgtest"
)

// produceTransactions writes to partition 0 of topic, from a
// transactional producer, the event n=0 in a transaction it aborts and
// n=1 in one it commits, then n=2 outside any transaction.
func produceTransactions(t *testing.T, c *cluster, topic string) {
	t.Helper()
	ctx := t.Context()
	record := func(n int) *kgo.Record {
		v, err := json.Marshal(event{N: n})
		require.NoError(t, err)
		return &kgo.Record{Topic: topic, Partition: 0, Value: v,
			Headers: []kgo.RecordHeader{{Key: "id", Value: []byte("ev-" + string(rune('0'+n)))}}}
	}
	tp, err := kgo.NewClient(kgo.SeedBrokers(c.addrs...), kgo.TransactionalID(uniq("txn")),
		kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	defer tp.Close()
	for n, end := range []kgo.TransactionEndTry{kgo.TryAbort, kgo.TryCommit} {
		require.NoError(t, tp.BeginTransaction())
		require.NoError(t, tp.ProduceSync(ctx, record(n)).FirstErr())
		require.NoError(t, tp.EndTransaction(ctx, end))
	}
	plain, err := kgo.NewClient(kgo.SeedBrokers(c.addrs...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	defer plain.Close()
	require.NoError(t, plain.ProduceSync(ctx, record(2)).FirstErr())
}

// A record of a transaction its producer aborted was never published:
// sarama's default isolation level (read uncommitted) handed it to the
// handler all the same, an effect for an event that does not exist. The
// Source reads committed records only, unless Config.ReadUncommitted.
func TestAbortedTransactionsAreNotHandled(t *testing.T) {
	for _, tc := range []struct {
		name            string
		readUncommitted bool
		want            map[int]int
	}{
		{"default", false, map[int]int{1: 1, 2: 1}},
		{"read-uncommitted", true, map[int]int{0: 1, 1: 1, 2: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t)
			topic := uniq("orders")
			c.createTopic(topic, 1)
			produceTransactions(t, c, topic)
			db, _ := pgtest.Schema(t)
			_, err := db.Exec(context.Background(), effectsTable)
			require.NoError(t, err)

			cfg := c.config(uniq("g"), topic)
			cfg.ReadUncommitted = tc.readUncommitted
			src := c.open(cfg)
			r := startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
			// n=2 is the partition's last record: once it is handled,
			// every record before it was handed out or skipped.
			require.Eventually(t, func() bool { return effectsByN(t, db)[2] == 1 }, 30*time.Second, 10*time.Millisecond)
			require.NoError(t, r.stop())
			assert.Equal(t, tc.want, effectsByN(t, db))
		})
	}
}
