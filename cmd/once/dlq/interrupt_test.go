package dlq_test

import (
	"context"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/IBM/sarama"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/internal/netcut"
	"github.com/onceco/once/internal/pgtest"
)

// A replay whose connection to RabbitMQ is cut half-way returns an error;
// what it had not acked goes back to the dead-letter queue. Replayed again,
// every event has one effect, whether its first redrive got through or not,
// and the dead-letter queue ends empty.
func TestAMQPReplayCutHalfWayThenReplayedAgain(t *testing.T) {
	brokerURL := testenv.AMQPURL(t)
	queue := testenv.Uniq("orders")
	testenv.DeleteQueues(t, brokerURL, queue, queue+".dlq")
	pool, _ := pgtest.Schema(t)
	svc := testenv.StartService(t, pool, testenv.OpenAMQPSource(t, brokerURL, queue), "billing")
	ch := testenv.AMQPChannel(t, brokerURL)
	const n = 8
	for i := range n {
		testenv.PublishAMQP(t, ch, queue, amqp091.Publishing{MessageId: "pay-" + strconv.Itoa(i), Body: testenv.JSON(i, "fail")})
	}
	svc.WaitSettled(t, n)
	require.EqualValues(t, n, svc.C.Stats().DeadLettered)
	svc.Broken.Store(false)

	u, err := url.Parse(brokerURL)
	require.NoError(t, err)
	proxy, err := netcut.NewProxy(u.Host)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	u.Host = proxy.Addr()
	q, err := dlq.NewAMQP(dlq.AMQPConfig{URL: u.String(), Queue: queue + ".dlq"})
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := q.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{Progress: func(done, _ int, _ dlq.Outcome) {
		if done == 3 {
			proxy.Cut()
		}
	}})
	require.Error(t, err, "the connection was cut")
	assert.Equal(t, 3, rep.Replayed)

	rep, err = q.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{})
	require.NoError(t, err)
	assert.GreaterOrEqual(t, rep.Replayed, n-3, "what was not acked came back")
	svc.WaitSettled(t, uint64(n+3+rep.Replayed))
	effects := svc.Effects(t)
	require.Len(t, effects, n)
	for id, c := range effects {
		assert.Equal(t, 1, c, id)
	}
	left, err := dlq.Collect(ctx, q, dlq.Filter{})
	require.NoError(t, err)
	assert.Empty(t, left)
}

// A Kafka replay stopped half-way (the operator's Ctrl-C) reports what it
// did; replaying everything again afterwards leaves one effect per event.
func TestKafkaReplayStoppedHalfWayThenReplayedAgain(t *testing.T) {
	k := testenv.NewKafka(t)
	topic := testenv.Uniq("orders")
	k.CreateTopic(topic, 2)
	k.CreateTopic(topic+".dlq", 1)
	pool, _ := pgtest.Schema(t)
	const n = 8
	var msgs []*sarama.ProducerMessage
	for i := range n {
		msgs = append(msgs, kmsg(topic, int32(i%2), "", testenv.JSON(i, "fail"))) // no producer id
	}
	k.Produce(msgs...)
	svc := testenv.StartService(t, pool, k.Source(testenv.Uniq("g"), topic), "billing")
	svc.WaitSettled(t, n)
	svc.Broken.Store(false)
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: topic + ".dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)

	ctx, stop := context.WithCancel(context.Background())
	rep, err := q.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{Progress: func(done, _ int, _ dlq.Outcome) {
		if done == 3 {
			stop()
		}
	}})
	require.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, 3, rep.Replayed)
	rep, err = q.Replay(context.Background(), dlq.Filter{}, dlq.ReplayOptions{})
	require.NoError(t, err)
	assert.Equal(t, n, rep.Replayed)
	svc.WaitSettled(t, n+3+n)
	effects := svc.Effects(t)
	require.Len(t, effects, n)
	for id, c := range effects {
		assert.Equal(t, 1, c, id)
	}
	assert.EqualValues(t, 3, svc.C.Stats().Duplicates, "the first replay's three were skipped the second time")
}
