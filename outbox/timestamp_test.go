package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/kafkatemp"
	"github.com/onceco/once/internal/kafkatest"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/kafkaout"
)

// A topic that bounds how old a record's timestamp may be
// (message.timestamp.before.max.ms) refuses a row written before that
// window (the relay was down, a parked row requeued days later) with
// INVALID_TIMESTAMP on every attempt: the row is sent with its created_at.
// The publisher took that for a broker unavailable: the row was retried
// without end, never charged nor parked, and the rows of its record batch,
// which the broker refuses with it, never went either. It is refused now
// (outbox.Rejected) and parked after MaxAttempts; the records of its
// record batch are sent again one at a time, so that the others go and the
// later rows of its key wait behind it.
func TestRowOlderThanTheTopicAcceptsIsParked(t *testing.T) {
	c := kafkatest.Shared(t)
	topic := uniq("old-ts")
	admin, err := sarama.NewClusterAdmin(c.Brokers(), kafkatemp.ProbeConfig())
	require.NoError(t, err)
	window := "3600000" // an hour
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"message.timestamp.before.max.ms": &window}}, false))
	require.NoError(t, admin.Close())

	pool, _ := migrated(t)
	ctx := context.Background()
	// "first" goes out alone, and the producer gathers the others in one
	// record batch while it waits for the broker's answer.
	addCommitted(t, pool,
		outbox.Message{Topic: topic, Key: []byte("x"), Body: []byte("first")},
		outbox.Message{Topic: topic, Key: []byte("k"), Body: []byte("old")},
		outbox.Message{Topic: topic, Key: []byte("k"), Body: []byte("behind-old")},
		outbox.Message{Topic: topic, Key: []byte("j"), Body: []byte("other")})
	_, err = pool.Exec(ctx, `UPDATE outbox SET created_at = now() - interval '2 days' WHERE body = 'old'`)
	require.NoError(t, err)

	pub, err := kafkaout.New(kafkaout.Config{Brokers: c.Brokers(), Sarama: kafkatemp.ProbeConfig()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}})

	waitRows(t, pool, "body = 'old' AND parked_at IS NOT NULL", 1, 30*time.Second)
	waitRows(t, pool, "body = 'other'", 0, 30*time.Second)
	assert.Equal(t, 1, rows(t, pool, "body = 'behind-old' AND parked_at IS NULL AND attempts = 0"),
		"the later row of the parked row's key waits, uncharged")
	var lastErr string
	require.NoError(t, pool.QueryRow(ctx, `SELECT last_error FROM outbox WHERE body = 'old'`).Scan(&lastErr))
	assert.Contains(t, lastErr, "imestamp")

	msgs, err := readTopic(c.Brokers(), topic)
	require.NoError(t, err)
	var got []string
	for _, m := range msgs {
		got = append(got, string(m.Value))
	}
	assert.Equal(t, []string{"first", "other"}, got)
}
