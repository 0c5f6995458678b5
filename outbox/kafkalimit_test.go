package outbox_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// A row whose record is as large as Producer.MaxMessageBytes allows, on a
// topic whose max.message.bytes equals it (docs/outbox.md: keep the
// producer's limit at or below the topics'), passed the publisher's size
// check but not the broker, which measures the record batch around it
// (61 bytes more): refused by the broker alone, while the row behind it
// of its key, sent in the next request, was confirmed ahead of it. The
// check counts the batch's overhead: the row is refused before anything
// of its batch is sent, and its key waits.
func TestKafkaRowAtTheProducerLimitIsRefusedBeforeItsKeyGoesOn(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	const limit = 64 << 10 // the test publisher's Producer.MaxMessageBytes
	topic := uniq("limit")
	createTopicLimited(t, k, topic, limit)
	d := &kafkaDest{k: k, topic: topic}
	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{
		PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond},
		Logger:       testLogger(),
	})
	big := outbox.Message{ID: "a/2", Topic: topic, Key: []byte("a")}
	big.Body = make([]byte, limit-recordSize(big))
	require.Equal(t, limit, recordSize(big), "the record is exactly at the producer's limit")
	addCommitted(t, pool, outbox.Message{ID: "a/1", Topic: topic, Key: []byte("a"), Body: []byte("a/1")}, big,
		outbox.Message{ID: "a/3", Topic: topic, Key: []byte("a"), Body: []byte("a/3")},
		outbox.Message{ID: "b/1", Topic: topic, Key: []byte("b"), Body: []byte("b/1")})
	waitRows(t, pool, "parked_at IS NOT NULL", 1, 30*time.Second)
	got := d.read(t, 2)
	assert.ElementsMatch(t, []string{"a/1", "b/1"}, bodies(got), "a/3 must not overtake the refused a/2")
	assert.Equal(t, 1, rows(t, pool, "parked_at IS NULL AND sent_at IS NULL"), "a/3 waits behind the parked row")
}

// recordSize is the size sarama gives the Kafka record of m (its Producer.
// MaxMessageBytes check) as kafkaout sends it: the id header added.
func recordSize(m outbox.Message) int {
	pm := &sarama.ProducerMessage{Topic: m.Topic, Key: sarama.ByteEncoder(m.Key), Value: sarama.ByteEncoder(m.Body),
		Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(m.ID)}}}
	return pm.ByteSize(2)
}

// createTopicLimited creates topic with one partition and max.message.bytes
// limit.
func createTopicLimited(t testing.TB, k *kafkaBroker, topic string, limit int) {
	t.Helper()
	admin, err := sarama.NewClusterAdmin(k.addrs, saramaConfig())
	require.NoError(t, err)
	defer admin.Close()
	l := strconv.Itoa(limit)
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"max.message.bytes": &l}}, false))
}
