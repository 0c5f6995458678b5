package dlq_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/IBM/sarama"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

const benchRecords = 2000

// deadLetterHeaders are headers like a consumer's dead-lettering writes.
func deadLetterHeaders(i int) map[string]string {
	return map[string]string{
		consumer.HeaderEventID: "ev-" + strconv.Itoa(i), consumer.HeaderConsumer: "billing",
		consumer.HeaderErrorKind: "handler", consumer.HeaderErrorMessage: "payment service rejected the order",
		consumer.HeaderFailedAt: "2026-11-25T10:00:00Z", consumer.HeaderOriginalTopic: "orders",
		"once-original-exchange": "", "once-original-routing-key": "orders",
	}
}

// BenchmarkKafka reads (browse) or redrives (replay, one confirmed publish
// at a time) a dead-letter topic of 2000 records, kfake over TCP.
func BenchmarkKafka(b *testing.B) {
	k := testenv.NewKafka(b)
	k.CreateTopic("orders.dlq", 1)
	k.CreateTopic("orders", 1)
	var msgs []*sarama.ProducerMessage
	for i := range benchRecords {
		m := &sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.ByteEncoder(testenv.JSON(i, "fail"))}
		for key, v := range deadLetterHeaders(i) {
			m.Headers = append(m.Headers, sarama.RecordHeader{Key: []byte(key), Value: []byte(v)})
		}
		msgs = append(msgs, m)
	}
	k.Produce(msgs...)
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(b, err)
	b.Run("browse", func(b *testing.B) { browse(b, q) })
	b.Run("replay", func(b *testing.B) { replay(b, q) })
}

// BenchmarkAMQP reads (taken and put back) or redrives (keeping them) a
// dead-letter queue of 2000 messages.
func BenchmarkAMQP(b *testing.B) {
	u := testenv.AMQPURL(b)
	name := testenv.Uniq("bench.dlq")
	testenv.DeleteQueues(b, u, name)
	ch := testenv.AMQPChannel(b, u)
	_, err := ch.QueueDeclare(name, true, false, false, false, nil)
	require.NoError(b, err)
	for i := range benchRecords {
		h := amqp091.Table{}
		for key, v := range deadLetterHeaders(i) {
			h[key] = v
		}
		testenv.PublishAMQP(b, ch, name, amqp091.Publishing{Body: testenv.JSON(i, "fail"), Headers: h})
	}
	_, err = ch.QueueDeclare("orders", true, false, false, false, nil)
	require.NoError(b, err)
	b.Cleanup(func() { _, _ = ch.QueueDelete("orders", false, false, false) })
	q, err := dlq.NewAMQP(dlq.AMQPConfig{URL: u, Queue: name})
	require.NoError(b, err)
	b.Run("browse", func(b *testing.B) { browse(b, q) })
	b.Run("replay-keep", func(b *testing.B) { replay(b, q) })
}

func browse(b *testing.B, q dlq.Queue) {
	b.ResetTimer()
	for b.Loop() {
		recs, err := dlq.Collect(context.Background(), q, dlq.Filter{})
		require.NoError(b, err)
		require.Len(b, recs, benchRecords)
	}
	b.ReportMetric(float64(benchRecords*b.N)/b.Elapsed().Seconds(), "records/s")
}

func replay(b *testing.B, q dlq.Queue) {
	b.ResetTimer()
	for b.Loop() {
		rep, err := q.Replay(context.Background(), dlq.Filter{}, dlq.ReplayOptions{Keep: true})
		require.NoError(b, err)
		require.Equal(b, benchRecords, rep.Replayed)
	}
	b.ReportMetric(float64(benchRecords*b.N)/b.Elapsed().Seconds(), "records/s")
}
