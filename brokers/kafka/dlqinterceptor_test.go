package kafka

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
)

// traceInjector is a producer interceptor as OpenTelemetry instrumentation
// of sarama installs: it writes the traceparent of a span of its own on
// every record sent, in place of the record's.
type traceInjector struct{ calls atomic.Int32 }

func (i *traceInjector) OnSend(m *sarama.ProducerMessage) {
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

// A base configuration whose producer interceptors instrument the
// service's own producers (OpenTelemetry's, which write each record's
// traceparent) ran them on the dead-letter copies too: the copy's
// traceparent, which links it to the failure's span, was replaced by one
// of the interceptor's span, and the redrive's trace lost the failure. The
// dead-letter producer runs no interceptor; the copy is written as the
// docs describe it.
func TestDeadLetterCopyIsNotChangedByTheBasesInterceptors(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 1)
	c.produce(msg(topic, 0, "poison", consumer.HeaderTraceParent, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"))
	cfg := c.config(uniq("g"), topic)
	base := saramaConfig()
	inject := &traceInjector{}
	base.Producer.Interceptors = []sarama.ProducerInterceptor{inject}
	cfg.Sarama = base
	s := c.open(cfg)
	d := receive(t, s)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	const failure = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	require.NoError(t, d.DeadLetter(ctx, &consumer.DeadLetter{Kind: consumer.KindHandler, FailedAt: time.Now(), TraceParent: failure}))
	recs := c.readAll(topic + ".dlq")
	require.Len(t, recs, 1)
	var traceparents []string
	for _, h := range recs[0].Headers {
		if string(h.Key) == consumer.HeaderTraceParent {
			traceparents = append(traceparents, string(h.Value))
		}
	}
	assert.Equal(t, []string{failure}, traceparents, "the copy links to the failure's span")
	assert.Zero(t, inject.calls.Load(), "no interceptor runs on a copy")
	assert.Len(t, base.Producer.Interceptors, 1, "the caller's configuration is not modified")
}

// decrypt is a consumer interceptor that changes what the consumer reads,
// as a decrypting or decompressing one does.
type decrypt struct{ calls atomic.Int32 }

func (i *decrypt) OnConsume(m *sarama.ConsumerMessage) {
	i.calls.Add(1)
	m.Value = []byte("plain")
}

// sarama runs a base's Consumer.Interceptors on each record before the
// Source sees it (and twice on a record the Source is slow to take, past
// Consumer.MaxProcessingTime): the id, the value and the headers the
// consumer deduplicates on and the dead-letter copy is made of were the
// interceptor's, and a record dead-lettered was copied with the rewritten
// value (plaintext in the dead-letter topic, which a redrive put back on
// the source topic to be "decrypted" again), though docs/kafka.md promises
// the original value byte for byte. Clearing them would hand every handler
// the records untransformed without a word, so Open refuses them, naming
// the field.
func TestOpenRefusesConsumerInterceptors(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 1)
	c.produce(msg(topic, 0, "cipher"))
	cfg := c.config(uniq("g"), topic)
	base := saramaConfig()
	dec := &decrypt{}
	base.Consumer.Interceptors = []sarama.ConsumerInterceptor{dec}
	cfg.Sarama = base
	s, err := Open(t.Context(), cfg)
	if s != nil {
		_ = s.Close()
	}
	require.Error(t, err)
	assert.Contains(t, err.Error(), "Config.Sarama.Consumer.Interceptors")
	assert.Zero(t, dec.calls.Load(), "no record was read")
}
