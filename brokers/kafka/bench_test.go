package kafka

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// Run with a fixed count, e.g.
//
//	go test -run '^$' -bench . -benchtime 50000x ./brokers/kafka
//
// Each benchmark reports msgs/s, measured from the first record received
// to the last one settled.

const benchPartitions = 4

// benchTopic creates a topic with n records of ~200 bytes, each with an id
// header, spread over benchPartitions partitions.
func benchTopic(b *testing.B, c *cluster, n int) string {
	b.Helper()
	return benchTopicOf(b, c, n, true)
}

// benchTopicOf is benchTopic, with id headers or without (the records are
// then identified by their positions).
func benchTopicOf(b *testing.B, c *cluster, n int, withIDs bool) string {
	b.Helper()
	topic := uniq("bench")
	c.createTopic(topic, benchPartitions)
	sc := saramaConfig()
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForLocal
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	p, err := sarama.NewSyncProducer(c.addrs, sc)
	require.NoError(b, err)
	defer p.Close()
	pad := make([]byte, 160)
	for i := range pad {
		pad[i] = 'x'
	}
	const chunk = 5000
	for from := 0; from < n; from += chunk {
		msgs := make([]*sarama.ProducerMessage, 0, chunk)
		for i := from; i < min(from+chunk, n); i++ {
			m := &sarama.ProducerMessage{
				Topic:     topic,
				Partition: int32(i % benchPartitions),
				Key:       sarama.StringEncoder(fmt.Sprintf("key-%d", i%64)),
				Value:     sarama.StringEncoder(fmt.Sprintf(`{"n":%d,"pad":"%s"}`, i, pad)),
			}
			if withIDs {
				m.Headers = []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(fmt.Sprintf("ev-%d", i))}}
			}
			msgs = append(msgs, m)
		}
		require.NoError(b, p.SendMessages(msgs))
	}
	return topic
}

func benchSourceConfig(c *cluster, group, topic string) Config {
	cfg := c.config(group, topic)
	cfg.CommitInterval = time.Second
	cfg.FetchMaxWait = DefaultFetchMaxWait
	return cfg
}

// BenchmarkSourceReceiveAck: the adapter alone, no database: receive and
// ack every record (the ceiling of the Kafka side).
func BenchmarkSourceReceiveAck(b *testing.B) {
	c := newCluster(b)
	topic := benchTopic(b, c, b.N)
	s := c.open(benchSourceConfig(c, uniq("g"), topic))
	ctx := context.Background()

	first, err := s.Receive(ctx)
	require.NoError(b, err)
	b.ResetTimer()
	start := time.Now()
	require.NoError(b, first.Ack(ctx))
	for i := 1; i < b.N; i++ {
		d, err := s.Receive(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if err := d.Ack(ctx); err != nil {
			b.Fatal(err)
		}
	}
	elapsed := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
	require.NoError(b, s.Close())
}

// BenchmarkConsumer: the full consumer with PostgreSQL: per record, one
// transaction that claims the event id and writes one business row, then
// the offset is marked.
func BenchmarkConsumer(b *testing.B) {
	benchConsumer(b, true, false)
}

// BenchmarkConsumerOffsets compares, side by side, where offsets are kept
// (Config.OffsetsInDatabase or Kafka alone) for records with ids and for
// records without (identified by position, which in the database mode
// need no processed-events row):
//
//	go test -run '^$' -bench ConsumerOffsets -benchtime 50000x ./brokers/kafka
func BenchmarkConsumerOffsets(b *testing.B) {
	for _, ids := range []bool{true, false} {
		for _, inDB := range []bool{false, true} {
			name := map[bool]string{true: "ids", false: "no-ids"}[ids] + "/" +
				map[bool]string{true: "offsets-in-database", false: "offsets-in-kafka"}[inDB]
			b.Run(name, func(b *testing.B) { benchConsumer(b, ids, inDB) })
		}
	}
}

func benchConsumer(b *testing.B, withIDs, offsetsInDB bool) {
	c := newCluster(b)
	topic := benchTopicOf(b, c, b.N, withIDs)
	db, _ := pgtest.Schema(b)
	_, err := db.Exec(context.Background(), `CREATE TABLE effects (event_id text NOT NULL, n int NOT NULL)`)
	require.NoError(b, err)
	scfg := benchSourceConfig(c, uniq("g"), topic)
	scfg.OffsetsInDatabase = offsetsInDB
	src, err := Open(b.Context(), scfg)
	require.NoError(b, err)
	cfg := consumerConfig("bench")
	b.ResetTimer()
	r := startConsumer(b, db, src, cfg, recordEffect)
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	var start time.Time
	for range tick.C {
		st := r.c.Stats()
		if start.IsZero() && st.Received > 0 {
			start = time.Now()
		}
		if st.Handled >= uint64(b.N) {
			break
		}
	}
	elapsed := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
	require.NoError(b, r.stop())
	var rows int
	require.NoError(b, db.QueryRow(context.Background(), `SELECT count(DISTINCT event_id) FROM effects`).Scan(&rows))
	require.Equal(b, b.N, rows, "one business row per event")
}
