package dlq_test

import (
	"context"
	"net/url"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	kmsgs "github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/netcut"
)

// cancelWhenStuck runs op, cancels its context once stuck fires (op waits
// on a broker that does not answer) and returns op's error; the test fails
// unless op returns promptly after the cancel.
func cancelWhenStuck(t *testing.T, stuck <-chan struct{}, op func(context.Context) error) error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- op(ctx) }()
	select {
	case <-stuck:
	case err := <-done:
		t.Fatalf("returned before it waited on the broker: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("never waited on the broker")
	}
	cancel()
	select {
	case err := <-done:
		return err
	case <-time.After(5 * time.Second):
		t.Fatal("still running 5s after its context ended")
	}
	return nil
}

// unanswered makes the cluster leave requests of key unanswered, as a
// broker that hangs does, from the one after the first skip of them (of
// those that when accepts); stuck fires at the first one left.
func unanswered(k *testenv.Kafka, key kmsgs.Key, skip int, when func(kmsgs.Request) bool) <-chan struct{} {
	stuck := make(chan struct{})
	var seen atomic.Int32
	k.Cluster.ControlKey(int16(key), func(req kmsgs.Request) (kmsgs.Response, error, bool) {
		if when != nil && !when(req) {
			return nil, nil, false
		}
		if n := seen.Add(1); n <= int32(skip) {
			return nil, nil, false
		} else if n == int32(skip)+1 {
			close(stuck)
		}
		k.Cluster.KeepControl()
		return nil, nil, true
	})
	return stuck
}

// A read or a replay whose context ends while the Kafka client waits on a
// broker that does not answer returns at once: the client's own timeouts
// (30 s a request, retried) are not waited out, so an interrupted command
// ends and the console's next page on the topic is not kept waiting. A
// replay cut off reports exactly what the broker confirmed.
func TestKafkaCallsStopWhenTheirContextEnds(t *testing.T) {
	t.Run("connect", func(t *testing.T) {
		addr, accepted := testenv.SilentBroker(t)
		q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: []string{addr}, Topic: "orders.dlq"})
		require.NoError(t, err)
		err = cancelWhenStuck(t, accepted, func(ctx context.Context) error {
			return q.Browse(ctx, func(*dlq.Record) error { return nil })
		})
		assert.ErrorIs(t, err, context.Canceled)
	})

	t.Run("offsets", func(t *testing.T) {
		k := testenv.NewKafka(t)
		k.CreateTopic("orders.dlq", 1)
		k.Produce(&sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.StringEncoder("{}")})
		q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
		require.NoError(t, err)
		stuck := unanswered(k, kmsgs.ListOffsets, 0, nil)
		err = cancelWhenStuck(t, stuck, func(ctx context.Context) error {
			return q.Browse(ctx, func(*dlq.Record) error { return nil })
		})
		assert.ErrorIs(t, err, context.Canceled)
	})

	t.Run("replay", func(t *testing.T) {
		k := testenv.NewKafka(t)
		k.CreateTopic("orders", 1)
		k.CreateTopic("orders.dlq", 1)
		const n = 4
		for i := range n {
			k.Produce(&sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.StringEncoder("{}"), Headers: []sarama.RecordHeader{
				{Key: []byte(consumer.HeaderEventID), Value: []byte("e-" + strconv.Itoa(i))},
				{Key: []byte(consumer.HeaderOriginalTopic), Value: []byte("orders")},
				{Key: []byte(consumer.HeaderOriginalPartition), Value: []byte("0")},
			}})
		}
		q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
		require.NoError(t, err)
		toOrders := func(req kmsgs.Request) bool {
			p := req.(*kmsgs.ProduceRequest)
			return len(p.Topics) > 0 && p.Topics[0].Topic == "orders"
		}
		stuck := unanswered(k, kmsgs.Produce, 2, toOrders)
		var rep dlq.Report
		err = cancelWhenStuck(t, stuck, func(ctx context.Context) error {
			var err error
			rep, err = q.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{})
			return err
		})
		assert.ErrorIs(t, err, context.Canceled)
		assert.Equal(t, 2, rep.Replayed, "the report counts what the broker confirmed")
		assert.Len(t, rep.Outcomes, 2)

		orders, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders", Sarama: testenv.Sarama()})
		require.NoError(t, err)
		recs, err := dlq.Collect(context.Background(), orders, dlq.Filter{})
		require.NoError(t, err)
		assert.Len(t, recs, 2, "the record left unanswered was not written")
	})
}

// A read or a replay of a RabbitMQ queue whose context ends while the
// broker does not answer returns at once, or, holding messages to put
// back, within the queue's IdleTimeout: not after the handshake's 30 s or
// the heartbeats' timeout. A replay cut off reports exactly what the
// broker confirmed, and only that left the dead-letter queue.
func TestAMQPCallsStopWhenTheirContextEnds(t *testing.T) {
	t.Run("connect", func(t *testing.T) {
		addr, accepted := testenv.SilentBroker(t)
		q, err := dlq.NewAMQP(dlq.AMQPConfig{URL: "amqp://guest:guest@" + addr + "/", Queue: "orders.dlq"})
		require.NoError(t, err)
		err = cancelWhenStuck(t, accepted, func(ctx context.Context) error {
			return q.Browse(ctx, func(*dlq.Record) error { return nil })
		})
		assert.ErrorIs(t, err, context.Canceled)
	})

	t.Run("replay", func(t *testing.T) {
		brokerURL := testenv.AMQPURL(t)
		name, target := testenv.Uniq("orders.dlq"), testenv.Uniq("orders")
		testenv.DeleteQueues(t, brokerURL, name, target)
		ch := testenv.AMQPChannel(t, brokerURL)
		for _, q := range []string{name, target} {
			_, err := ch.QueueDeclare(q, true, false, false, false, nil)
			require.NoError(t, err)
		}
		const n = 4
		for i := range n {
			testenv.PublishAMQP(t, ch, name, amqp091.Publishing{Body: []byte("{}"), Headers: amqp091.Table{
				consumer.HeaderEventID: "e-" + strconv.Itoa(i), "once-original-exchange": "", "once-original-routing-key": target}})
		}
		u, err := url.Parse(brokerURL)
		require.NoError(t, err)
		proxy, err := netcut.NewProxy(u.Host)
		require.NoError(t, err)
		t.Cleanup(func() { _ = proxy.Close() })
		u.Host = proxy.Addr()
		q, err := dlq.NewAMQP(dlq.AMQPConfig{URL: u.String(), Queue: name})
		require.NoError(t, err)

		// After two redrives the broker hears nothing more.
		stuck := make(chan struct{})
		var rep dlq.Report
		err = cancelWhenStuck(t, stuck, func(ctx context.Context) error {
			var err error
			rep, err = q.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{Progress: func(done, _ int, _ dlq.Outcome) {
				if done == 2 {
					proxy.Pause()
					close(stuck)
				}
			}})
			return err
		})
		proxy.Resume()
		assert.ErrorIs(t, err, context.Canceled)
		assert.Equal(t, 2, rep.Replayed, "the report counts what the broker confirmed")

		direct, err := dlq.NewAMQP(dlq.AMQPConfig{URL: brokerURL, Queue: name})
		require.NoError(t, err)
		var left []*dlq.Record
		require.Eventually(t, func() bool {
			left, err = dlq.Collect(context.Background(), direct, dlq.Filter{})
			return err == nil && len(left) == n-2
		}, 30*time.Second, 50*time.Millisecond, "the dead letters not confirmed are back: %v", err)
		assert.Equal(t, "e-2", left[0].EventID())
		assert.Equal(t, "e-3", left[1].EventID())
	})
}
