package dlq_test

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// Dead letters that cannot go back: to an exchange that no longer exists,
// to a routing key no queue is bound to, without an event id, without any
// once header at all. The replay skips what is not replayable, stops with
// an error at what the broker refuses, and removes nothing it did not
// publish.
func TestAMQPReplayOfRecordsThatCannotGoBack(t *testing.T) {
	u := testenv.AMQPURL(t)
	name := testenv.Uniq("garbage.dlq")
	testenv.DeleteQueues(t, u, name)
	ch := testenv.AMQPChannel(t, u)
	_, err := ch.QueueDeclare(name, true, false, false, false, nil)
	require.NoError(t, err)
	publish := func(h amqp091.Table) {
		testenv.PublishAMQP(t, ch, name, amqp091.Publishing{Body: []byte("x"), Headers: h})
	}
	publish(amqp091.Table{"some": "header"})                                                     // not from once
	publish(amqp091.Table{consumer.HeaderErrorKind: "missing-id", "once-original-exchange": ""}) // no id
	publish(amqp091.Table{consumer.HeaderEventID: "e-1", "once-original-exchange": "", "once-original-routing-key": "no-such-queue-" + name})
	publish(amqp091.Table{consumer.HeaderEventID: "e-2", "once-original-exchange": "no-such-exchange-" + name, "once-original-routing-key": "x"})

	q, err := dlq.NewAMQP(dlq.AMQPConfig{URL: u, Queue: name})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	rep, err := q.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "unroutable")
	assert.Equal(t, 2, rep.Skipped, "no once headers, no event id")
	assert.Zero(t, rep.Replayed)

	rep, err = q.Replay(ctx, dlq.Filter{EventID: "e-2"}, dlq.ReplayOptions{})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "NOT_FOUND")
	assert.Contains(t, err.Error(), "no-such-exchange")
	assert.Zero(t, rep.Replayed)

	recs, err := dlq.Collect(ctx, q, dlq.Filter{})
	require.NoError(t, err)
	assert.Len(t, recs, 4, "nothing was removed")
}

// On Kafka: records not written by once, a copy written without its value,
// and a record whose original topic is gone.
func TestKafkaReplayOfRecordsThatCannotGoBack(t *testing.T) {
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 1)
	rec := func(value string, h ...string) *sarama.ProducerMessage {
		m := &sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.StringEncoder(value)}
		for i := 0; i+1 < len(h); i += 2 {
			m.Headers = append(m.Headers, sarama.RecordHeader{Key: []byte(h[i]), Value: []byte(h[i+1])})
		}
		return m
	}
	k.Produce(
		rec("junk"),
		rec("", consumer.HeaderEventID, "e-1", consumer.HeaderOriginalTopic, "orders", "once-value-dropped", "2000000"),
		rec("{}", consumer.HeaderEventID, "e-2", consumer.HeaderOriginalTopic, "gone"),
	)
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rep, err := q.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "gone")
	assert.Equal(t, 2, rep.Skipped)
	assert.Contains(t, rep.Outcomes[1].Reason, "without its value")

	_, err = dlq.NewKafka(dlq.KafkaConfig{Topic: "x"})
	assert.Error(t, err)
	missing, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "no-such.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	_, err = dlq.Collect(ctx, missing, dlq.Filter{})
	assert.Error(t, err, "a missing dead-letter topic is an error, not an empty list")
}
