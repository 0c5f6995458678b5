package dlq_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// stampTrace is a producer interceptor as OpenTelemetry instrumentation of
// sarama installs: it writes the traceparent of a span of its own on every
// record sent, in place of the record's.
type stampTrace struct{ calls atomic.Int32 }

func (i *stampTrace) OnSend(m *sarama.ProducerMessage) {
	i.calls.Add(1)
	kept := m.Headers[:0]
	for _, h := range m.Headers {
		if string(h.Key) != consumer.HeaderTraceParent {
			kept = append(kept, h)
		}
	}
	m.Headers = append(kept, sarama.RecordHeader{Key: []byte(consumer.HeaderTraceParent),
		Value: []byte("00-ffffffffffffffffffffffffffffffff-ffffffffffffffff-01")})
}

// rewriteValue is a consumer interceptor that changes what is read, as a
// decrypting or decompressing one of the service's own consumers does.
type rewriteValue struct{ calls atomic.Int32 }

func (i *rewriteValue) OnConsume(m *sarama.ConsumerMessage) {
	i.calls.Add(1)
	m.Value = []byte("rewritten")
}

// A base configuration whose interceptors instrument (or transform) the
// service's own clients ran them on the replay too: the producer's
// replaced the traceparent the dead letter carries (the failure's span,
// which the redrive's trace continues), and the consumer's changed the
// dead letters as read, so that list and show printed, and the replay
// redrove, records that are not on the topic. Neither runs: the redrive is
// the dead letter as written, plus the redrive headers.
func TestKafkaReplayIsNotChangedByTheBasesInterceptors(t *testing.T) {
	k := testenv.NewKafka(t)
	topic := testenv.Uniq("orders")
	k.CreateTopic(topic, 1)
	k.CreateTopic(topic+".dlq", 1)
	const failure = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	k.Produce(&sarama.ProducerMessage{Topic: topic + ".dlq", Value: sarama.StringEncoder(`{"n":1}`), Headers: []sarama.RecordHeader{
		{Key: []byte("id"), Value: []byte("e-1")},
		{Key: []byte(consumer.HeaderTraceParent), Value: []byte(failure)},
		{Key: []byte(consumer.HeaderEventID), Value: []byte("e-1")},
		{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
		{Key: []byte(consumer.HeaderOriginalTopic), Value: []byte(topic)},
	}})
	base := testenv.Sarama()
	send, consume := &stampTrace{}, &rewriteValue{}
	base.Producer.Interceptors = []sarama.ProducerInterceptor{send}
	base.Consumer.Interceptors = []sarama.ConsumerInterceptor{consume}
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: topic + ".dlq", Sarama: base})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := q.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{})
	require.NoError(t, err)
	require.Equal(t, 1, rep.Replayed)

	// Read back without interceptors: what the topic holds.
	src, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: topic, Sarama: testenv.Sarama()})
	require.NoError(t, err)
	recs, err := dlq.Collect(ctx, src, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, recs, 1)
	r := recs[0]
	assert.Equal(t, `{"n":1}`, string(r.Value), "the redrive carries the dead letter's value")
	var traceparents []string
	for _, h := range r.Headers {
		if h.Key == consumer.HeaderTraceParent {
			traceparents = append(traceparents, h.Value)
		}
	}
	assert.Equal(t, []string{failure}, traceparents, "the redrive continues the failure's trace")
	assert.Equal(t, "e-1", r.Header(consumer.HeaderRedriveEventID))
	assert.Equal(t, "e-1", r.Header("id"))
	assert.Zero(t, send.calls.Load(), "no producer interceptor runs on a redrive")
	assert.Zero(t, consume.calls.Load(), "no consumer interceptor runs on a dead letter read")
	assert.Len(t, base.Producer.Interceptors, 1, "the caller's configuration is not modified")
	assert.Len(t, base.Consumer.Interceptors, 1, "the caller's configuration is not modified")
}
