package kafka

import (
	"context"
	"fmt"
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
	src, err := NewSource(c.config(uniq("g"), topic)) // default sarama producer limits
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
	t.Cleanup(func() { cancel(); <-done })
	return c
}
