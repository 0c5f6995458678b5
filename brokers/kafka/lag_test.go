package kafka

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// lagOf returns the lag gauge's values by "topic/partition".
func lagOf(t testing.TB, reader *sdkmetric.ManualReader) map[string]int64 {
	return partitionValues(t, reader, LagMetricName)
}

// partitionValues returns the values of the int64 gauge or counter named
// name by "topic/partition".
func partitionValues(t testing.TB, reader *sdkmetric.ManualReader, name string) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			var points []metricdata.DataPoint[int64]
			switch data := m.Data.(type) {
			case metricdata.Gauge[int64]:
				points = data.DataPoints
			case metricdata.Sum[int64]:
				points = data.DataPoints
			}
			for _, dp := range points {
				tp, _ := dp.Attributes.Value("messaging.destination.name")
				p, _ := dp.Attributes.Value("messaging.destination.partition.id")
				out[tp.AsString()+"/"+p.AsString()] = dp.Value
			}
		}
	}
	return out
}

// With OffsetsInDatabase, records the offsets table records done above its
// prefix (finished out of order by key lanes before a crash) are skipped
// without being handed out. They are read all the same: once the last of
// them is skipped the partition has no lag, though the last record handed
// out is before them.
func TestLagCountsSkippedRecordsAsRead(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	c.produceHashed(idless(topic, 0, 10))
	db, _ := pgtest.Schema(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, effectsTable)
	require.NoError(t, err)

	// The row a crash leaves: record 0 not done, 1..9 done above it.
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, db))
	got, err := store.TakeOverPartitions(ctx, db, "svc", dedup.Owner{Group: group},
		[]dedup.PartitionKey{{Topic: topic, Partition: 0, TopicID: c.topicID(topic)}})
	require.NoError(t, err)
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, store.RecordOffsets(ctx, tx, "svc", dedup.OffsetsUpdate{Topic: topic, Partition: 0, Epoch: got[0].Epoch,
		DoneBelow: 0, Done: []int64{1, 2, 3, 4, 5, 6, 7, 8, 9}}))
	require.NoError(t, tx.Commit(ctx))

	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	cfg := c.dbOffsetsConfig(group, topic)
	cfg.MeterProvider = mp
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	r := startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
	waitEffectsByN(t, db, 1)
	require.Eventually(t, func() bool { return src.skippedRecords() == 9 }, 10*time.Second, 10*time.Millisecond)
	assert.Eventually(t, func() bool { return lagOf(t, reader)[topic+"/0"] == 0 }, 5*time.Second, 20*time.Millisecond,
		"every record of the partition was read; lag %v", lagOf(t, reader))
	require.NoError(t, r.stop())
	assert.Equal(t, map[int]int{0: 1}, effectsByN(t, db), "only record 0 was handled")
}

// A partition paused at Config.MaxPendingPerPartition (a stuck record)
// fetches nothing, so sarama's high-water mark of it stops moving; the lag
// gauge still counts the records produced to it meanwhile, which is when
// an operator needs it most.
func TestLagOfAPausedPartitionCountsRecordsProducedMeanwhile(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	c.produce(msg(topic, 0, "stuck"))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	cfg := c.config(group, topic)
	cfg.MeterProvider = mp
	cfg.MaxPendingPerPartition = 1
	src := c.open(cfg)
	receive(t, src) // never acked: the claim waits at the bound, fetching paused
	require.Eventually(t, func() bool { return src.claimsWaitingForRoom() == 1 }, 10*time.Second, 5*time.Millisecond)

	var msgs []*sarama.ProducerMessage
	for i := range 100 {
		msgs = append(msgs, msg(topic, 0, fmt.Sprint(i)))
	}
	c.produce(msgs...)
	assert.Eventually(t, func() bool { return lagOf(t, reader)[topic+"/0"] == 100 }, 5*time.Second, 20*time.Millisecond,
		"the records produced while the partition is paused are its lag; lag %v", lagOf(t, reader))
}

// The lag of a paused partition is asked of the cluster during the
// collection: a broker that did not answer (ListOffsets held) held the
// whole collection, every metric of the process with it, for sarama's
// read timeout (30 s) per paused partition. The question waits at most a
// second; the gauge then reports the last answer.
func TestLagCollectionDoesNotWaitForAHungBroker(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	c.produce(msg(topic, 0, "stuck"), msg(topic, 0, "behind"))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	cfg := c.config(group, topic)
	cfg.MeterProvider = mp
	cfg.MaxPendingPerPartition = 1
	src := c.open(cfg)
	receive(t, src) // never acked: the claim waits at the bound, fetching paused
	require.Eventually(t, func() bool { return src.claimsWaitingForRoom() == 1 }, 10*time.Second, 5*time.Millisecond)
	require.Eventually(t, func() bool { return lagOf(t, reader)[topic+"/0"] == 1 }, 5*time.Second, 20*time.Millisecond)

	release := make(chan struct{})
	defer close(release)
	c.kf.ControlKey(kmsg.ListOffsets.Int16(), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.kf.KeepControl()
		c.kf.SleepControl(func() { <-release })
		return nil, nil, false
	})
	for range 3 {
		done := make(chan map[string]int64, 1)
		go func() { done <- lagOf(t, reader) }()
		select {
		case lag := <-done:
			assert.Equal(t, int64(1), lag[topic+"/0"], "the last answer")
		case <-time.After(5 * time.Second):
			t.Fatal("the collection waits for the broker")
		}
	}
}

// Reading committed records, the lag gauge counts the records the member
// will still be handed: it subtracted from the high-water mark, so the
// marker that ends each transaction (an offset no record uses) showed as a
// lag of 1 that never cleared once the member was caught up, and the
// records of aborted transactions and of a transaction still open, which
// the member is never handed (or not yet), counted as lag.
func TestLagCountsNoTransactionMarkersNorUnreadableRecords(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) { testLagCountsNoTransactionMarkers(t, kind) })
}

func testLagCountsNoTransactionMarkers(t *testing.T, kind brokerKind) {
	c := newClusterOf(t, kind)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	ctx := t.Context()
	var tp *kgo.Client
	transaction := func(end *kgo.TransactionEndTry, values ...string) {
		// A producer per transaction.
		var err error
		tp, err = kgo.NewClient(kgo.SeedBrokers(c.addrs...), kgo.TransactionalID(uniq("txn")),
			kgo.RecordPartitioner(kgo.ManualPartitioner()))
		require.NoError(t, err)
		t.Cleanup(tp.Close)
		require.NoError(t, tp.BeginTransaction())
		for _, v := range values {
			require.NoError(t, tp.ProduceSync(ctx, &kgo.Record{Topic: topic, Partition: 0, Value: []byte(v)}).FirstErr())
		}
		if end != nil {
			require.NoError(t, tp.EndTransaction(ctx, *end))
		}
	}
	commit, abort := kgo.TryCommit, kgo.TryAbort

	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	cfg := c.config(group, topic)
	cfg.MeterProvider = mp
	src := c.open(cfg)

	transaction(&commit, "a") // a at 0, its commit marker at 1
	require.Equal(t, "a", string(receive(t, src).Message().Value))
	assert.Eventually(t, func() bool { return lagOf(t, reader)[topic+"/0"] == 0 }, 5*time.Second, 20*time.Millisecond,
		"caught up after a committed transaction; lag %v", lagOf(t, reader))

	transaction(&abort, "x", "y", "z") // never handed out; its abort marker at 5
	// The high-water mark the member's fetches saw passed the aborted
	// transaction: the gauge's answer is then about it.
	hwm := func() int64 {
		src.lag.mu.Lock()
		defer src.lag.mu.Unlock()
		for cl := range src.lag.claims {
			return cl.sc.HighWaterMarkOffset()
		}
		return -1
	}
	require.Eventually(t, func() bool { return hwm() == 6 }, 10*time.Second, 10*time.Millisecond)
	assert.Eventually(t, func() bool { return lagOf(t, reader)[topic+"/0"] == 0 }, 5*time.Second, 20*time.Millisecond,
		"an aborted transaction's records are never handed out; lag %v", lagOf(t, reader))

	transaction(nil, "open1", "open2") // still open: not readable yet
	// The cluster's high-water mark is past them (the member's fetches,
	// which return nothing of them, do not move sarama's).
	client, err := sarama.NewClient(c.addrs, saramaConfig())
	require.NoError(t, err)
	defer client.Close()
	end, err := client.GetOffset(topic, 0, sarama.OffsetNewest)
	require.NoError(t, err)
	require.Equal(t, int64(8), end)
	assert.Equal(t, int64(0), lagOf(t, reader)[topic+"/0"], "an open transaction's records are not readable yet")

	require.NoError(t, tp.EndTransaction(ctx, kgo.TryCommit))
	// Its two records, and the marker after them (an offset between the
	// first record to hand out and the partition's end).
	assert.Eventually(t, func() bool { return lagOf(t, reader)[topic+"/0"] == 3 }, 5*time.Second, 20*time.Millisecond,
		"the committed transaction's records are lag until handed out; lag %v", lagOf(t, reader))
	receiveN(t, src, 2)
	assert.Eventually(t, func() bool { return lagOf(t, reader)[topic+"/0"] == 0 }, 5*time.Second, 20*time.Millisecond,
		"caught up again; lag %v", lagOf(t, reader))
}
