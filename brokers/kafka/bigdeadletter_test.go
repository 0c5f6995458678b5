package kafka

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// A poison record the topic accepts but the dead-letter producer cannot
// write (over sarama's default Producer.MaxMessageBytes, 1 MB) must still
// end in the dead-letter topic, not block its partition forever.
func TestPoisonOverDeadLetterProducerLimitDoesNotBlock(t *testing.T) {
	c := newCluster(t, kfake.BrokerConfigs(map[string]string{"message.max.bytes": fmt.Sprint(maxMessageBytes)}))
	db, _ := pgtest.Schema(t)
	topic := uniq("big")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 1)
	sc := saramaConfig()
	sc.Producer.Return.Successes = true
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	sc.Producer.MaxMessageBytes = maxMessageBytes
	p, err := sarama.NewSyncProducer(c.addrs, sc)
	require.NoError(t, err)
	defer p.Close()
	big := append(bigJSON(tenMiB), '}') // too large for the dead-letter producer's default limit
	require.NoError(t, p.SendMessages([]*sarama.ProducerMessage{
		{Topic: topic, Value: sarama.ByteEncoder(big), Headers: []sarama.RecordHeader{hdr("id", "big")}},
		{Topic: topic, Value: sarama.StringEncoder(`{"order_id":"g","amount":1}`), Headers: []sarama.RecordHeader{hdr("id", "good")}},
	}))
	src, err := Open(t.Context(), c.config(uniq("g"), topic)) // default sarama producer limits
	require.NoError(t, err)
	h := func(context.Context, pgx.Tx, consumer.Event[badOrder]) error { return nil }
	r := startConsumerOf(t, db, src, h)
	require.Eventually(t, func() bool { s := r.Stats(); return s.Handled == 1 && s.DeadLettered == 1 },
		30*time.Second, 20*time.Millisecond, "the big poison is dead-lettered and the good record behind it handled")
	recs, err := readTopic(c.addrs, topic+".dlq")
	require.NoError(t, err)
	require.Len(t, recs, 1)
	assert.Nil(t, recs[0].Value, "the value is dropped from the copy")
	headers := map[string]string{}
	for _, rh := range recs[0].Headers {
		headers[string(rh.Key)] = string(rh.Value)
	}
	assert.Equal(t, fmt.Sprint(len(big)), headers[HeaderValueDropped])
	assert.Equal(t, "big", headers[consumer.HeaderEventID])
	assert.Equal(t, "0", headers[consumer.HeaderOriginalOffset], "the original can be found from the copy")
}

func startConsumerOf(t *testing.T, db *pgxpool.Pool, src consumer.Source, h consumer.Handler[badOrder]) *consumer.Consumer[badOrder] {
	t.Helper()
	c, err := consumer.New(db, src, h, consumerConfig("svc"))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Log(err)
		}
	})
	return c
}

// On Apache Kafka with its default limits (message.max.bytes 1048588), a
// record just under the broker's limit is accepted into its topic, but its
// dead-letter copy, which adds the diagnostic headers, is refused by the
// broker as too large. The copy is written without its value, with
// HeaderValueDropped and the original's coordinates, and the partition goes
// on: the good record behind it is handled.
func TestDeadLetterCopyOverBrokerLimitKeepsPartitionMoving(t *testing.T) {
	c := newClusterOf(t, apacheKafka)
	db, _ := pgtest.Schema(t)
	topic := uniq("big")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 1)
	// The producer's own limit is raised, so that the broker's is the one
	// that counts.
	sc := saramaConfig()
	sc.Producer.Return.Successes = true
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	sc.Producer.MaxMessageBytes = 2 << 20
	p, err := sarama.NewSyncProducer(c.addrs, sc)
	require.NoError(t, err)
	defer p.Close()
	big := bigJSON(1_047_000) // fits the broker's limit alone
	require.NoError(t, p.SendMessages([]*sarama.ProducerMessage{
		{Topic: topic, Value: sarama.ByteEncoder(big), Headers: []sarama.RecordHeader{hdr("id", "big")}},
		{Topic: topic, Value: sarama.StringEncoder(`{"order_id":"g","amount":1}`), Headers: []sarama.RecordHeader{hdr("id", "good")}},
	}))

	cfg := c.config(uniq("g"), topic)
	cfg.Sarama.Producer.MaxMessageBytes = 2 << 20 // the dead-letter producer lets it through too
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	reason := strings.Repeat("the order was refused by the payment service; ", 40) // a long error header
	h := func(_ context.Context, _ pgx.Tx, ev consumer.Event[badOrder]) error {
		if ev.ID == "big" {
			return consumer.Permanent(errors.New(reason))
		}
		return nil
	}
	r := startConsumerOf(t, db, src, h)
	require.Eventually(t, func() bool { s := r.Stats(); return s.Handled == 1 && s.DeadLettered == 1 },
		60*time.Second, 20*time.Millisecond, "the big poison is dead-lettered and the good record behind it handled")
	recs, err := readTopic(c.addrs, topic+".dlq")
	require.NoError(t, err)
	require.Len(t, recs, 1)
	assert.Zero(t, len(recs[0].Value), "the value is dropped from the copy the broker refused")
	headers := map[string]string{}
	for _, rh := range recs[0].Headers {
		headers[string(rh.Key)] = string(rh.Value)
	}
	assert.Equal(t, fmt.Sprint(len(big)), headers[HeaderValueDropped])
	assert.Equal(t, "big", headers[consumer.HeaderEventID])
	assert.Equal(t, topic, headers[consumer.HeaderOriginalTopic])
	assert.Equal(t, "0", headers[consumer.HeaderOriginalOffset], "the original can be found from the copy")
	assert.Contains(t, headers[consumer.HeaderErrorMessage], "refused by the payment service", "the reason is kept")
	orig := c.readAll(topic)
	require.Len(t, orig, 2)
	assert.True(t, bytes.Equal(big, orig[0].Value), "the original is where the headers say")
}

// An event id far over the limit is dead-lettered invalid-id, and its
// copy carries it twice: as the original header and as once-event-id.
// Each fits the topic alone, the copy does not, and dropping the copy's
// small value does not make it fit: the copy is written with its
// diagnostics alone (cut to 4 KiB each), so that the partition goes on.
func TestDeadLetterCopyTooLargeWithoutItsValueKeepsPartitionMoving(t *testing.T) {
	c := newCluster(t)
	db, _ := pgtest.Schema(t)
	topic := uniq("bigid")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 1)
	id := strings.Repeat("i", 600_000) // the topic takes it; twice it is over the producer's 1 MB
	value := `{"order_id":"o-1","amount":1}`
	c.produce(
		&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("k-1"), Value: sarama.StringEncoder(value),
			Headers: []sarama.RecordHeader{hdr("id", id), hdr("type", "order.created")}},
		&sarama.ProducerMessage{Topic: topic, Value: sarama.StringEncoder(`{"order_id":"g","amount":1}`),
			Headers: []sarama.RecordHeader{hdr("id", "good")}},
	)
	src, err := Open(t.Context(), c.config(uniq("g"), topic)) // default sarama producer limits
	require.NoError(t, err)
	h := func(context.Context, pgx.Tx, consumer.Event[badOrder]) error { return nil }
	r := startConsumerOf(t, db, src, h)
	ok := assert.Eventually(t, func() bool { s := r.Stats(); return s.Handled == 1 && s.DeadLettered == 1 },
		30*time.Second, 20*time.Millisecond, "the poison is dead-lettered and the good record behind it handled")
	require.True(t, ok, "stats %+v", r.Stats())
	recs, err := readTopic(c.addrs, topic+".dlq")
	require.NoError(t, err)
	require.Len(t, recs, 1)
	assert.Nil(t, recs[0].Value, "the value is dropped from the copy")
	assert.Nil(t, recs[0].Key, "the key is dropped from the copy")
	headers := map[string]string{}
	for _, rh := range recs[0].Headers {
		headers[string(rh.Key)] = string(rh.Value)
	}
	assert.NotContains(t, headers, "id", "the original headers are dropped")
	assert.Equal(t, fmt.Sprint(len(value)), headers[HeaderValueDropped])
	assert.Equal(t, string(consumer.KindInvalidID), headers[consumer.HeaderErrorKind])
	assert.Equal(t, topic, headers[consumer.HeaderOriginalTopic])
	assert.Equal(t, "0", headers[consumer.HeaderOriginalOffset], "the original can be found from the copy")
	assert.Equal(t, id[:4096], headers[consumer.HeaderEventID], "the event id is cut")
	assert.Equal(t, fmt.Sprint(len("k-1")+len("id")+len(id)+len("type")+len("order.created")), headers[HeaderOriginalDropped])
}

// A dead-letter topic with small segments (segment.bytes at Kafka 4's
// minimum, 1 MiB: a low-traffic topic such as a dead-letter one gets them
// so that retention, which deletes closed segments only, deletes on time)
// and its max.message.bytes raised for large dead letters, as the docs
// say to: Apache Kafka refuses a record batch larger than a segment with
// RECORD_LIST_TOO_LARGE, not MESSAGE_TOO_LARGE. The copy of a 2 MiB poison
// record was retried as it was, refused the same way each time, and its
// partition held for ever. A refusal for its size is one, whichever the
// broker's limit: the copy is written without its value, and the good
// record behind it is handled.
func TestDeadLetterCopyOverTheTopicsSegmentSizeKeepsPartitionMoving(t *testing.T) {
	c := newClusterOf(t, apacheKafka)
	db, _ := pgtest.Schema(t)
	topic := uniq("big")
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(t, err)
	defer admin.Close()
	const limit = 4 << 20
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"max.message.bytes": ptr(fmt.Sprint(limit))}}, false))
	require.NoError(t, admin.CreateTopic(topic+".dlq", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"max.message.bytes": ptr(fmt.Sprint(limit)), "segment.bytes": ptr("1048576")}}, false))
	c.awaitLeaders(topic, 1)
	c.awaitLeaders(topic+".dlq", 1)
	sc := saramaConfig()
	sc.Producer.Return.Successes = true
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	sc.Producer.MaxMessageBytes = limit
	p, err := sarama.NewSyncProducer(c.addrs, sc)
	require.NoError(t, err)
	defer p.Close()
	big := append(bigJSON(2<<20), '}') // malformed: dead-lettered decode
	require.NoError(t, p.SendMessages([]*sarama.ProducerMessage{
		{Topic: topic, Value: sarama.ByteEncoder(big), Headers: []sarama.RecordHeader{hdr("id", "big")}},
		{Topic: topic, Value: sarama.StringEncoder(`{"order_id":"g","amount":1}`), Headers: []sarama.RecordHeader{hdr("id", "good")}},
	}))

	cfg := c.config(uniq("g"), topic)
	cfg.Sarama.Producer.MaxMessageBytes = limit // the topic's limit, as the docs say for large dead letters
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	h := func(context.Context, pgx.Tx, consumer.Event[badOrder]) error { return nil }
	r := startConsumerOf(t, db, src, h)
	require.Eventually(t, func() bool { s := r.Stats(); return s.Handled == 1 && s.DeadLettered == 1 },
		60*time.Second, 20*time.Millisecond, "the big poison is dead-lettered and the good record behind it handled")
	recs, err := readTopic(c.addrs, topic+".dlq")
	require.NoError(t, err)
	require.Len(t, recs, 1)
	assert.Zero(t, len(recs[0].Value), "the value is dropped from the copy the broker refused")
	headers := map[string]string{}
	for _, rh := range recs[0].Headers {
		headers[string(rh.Key)] = string(rh.Value)
	}
	assert.Equal(t, fmt.Sprint(len(big)), headers[HeaderValueDropped])
	assert.Equal(t, "big", headers[consumer.HeaderEventID])
	assert.Equal(t, "0", headers[consumer.HeaderOriginalOffset], "the original can be found from the copy")
}
