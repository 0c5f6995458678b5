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
