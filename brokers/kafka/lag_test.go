package kafka

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kmsg"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// lagOf returns the lag gauge's values by "topic/partition".
func lagOf(t testing.TB, reader *sdkmetric.ManualReader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != LagMetricName {
				continue
			}
			for _, dp := range m.Data.(metricdata.Gauge[int64]).DataPoints {
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
