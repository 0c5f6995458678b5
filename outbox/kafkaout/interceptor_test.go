package kafkaout

import (
	"bytes"
	"sync/atomic"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/outbox"
)

// headerInjector is a producer interceptor as instrumentation installs
// (OpenTelemetry's writes a traceparent of its own span): it adds a header
// to every record sent.
type headerInjector struct{ calls atomic.Int32 }

func (i *headerInjector) OnSend(m *sarama.ProducerMessage) {
	i.calls.Add(1)
	m.Headers = append(m.Headers, sarama.RecordHeader{Key: []byte("traceparent"),
		Value: bytes.Repeat([]byte("f"), 200)})
}

// A base configuration whose producer interceptors instrument the
// service's own producers ran them on the outbox's records after Check:
// the headers they add made a record that Check took larger than
// Producer.MaxMessageBytes, and sarama refused it alone while the next row
// of its key, in the same batch, was confirmed ahead of it (docs/outbox.md
// promises a row too large is refused before anything of its batch is
// sent); and they replaced the traceparent the row carries from Add. The
// publisher runs no interceptor: a record Check takes is sent as it is.
func TestBaseInterceptorsDoNotRunOnTheOutboxsRecords(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "t"))
	require.NoError(t, err)
	defer kf.Close()
	base := sarama.NewConfig()
	base.Version = sarama.V2_8_0_0
	base.Producer.MaxMessageBytes = 10000
	inject := &headerInjector{}
	base.Producer.Interceptors = []sarama.ProducerInterceptor{inject}
	p, err := New(Config{Brokers: kf.ListenAddrs(), Sarama: base})
	require.NoError(t, err)
	defer p.Close()

	big := outbox.Record{Seq: 1, EventID: "e-1", Topic: "t", Key: []byte("k")}
	for n := base.Producer.MaxMessageBytes - 300; ; n++ {
		big.Body = make([]byte, n+1)
		if p.Check(big) != nil {
			big.Body = make([]byte, n)
			break
		}
	}
	require.NoError(t, p.Check(big))
	next := outbox.Record{Seq: 2, EventID: "e-2", Topic: "t", Key: []byte("k"), Body: []byte("b")}
	errs := p.Publish(t.Context(), []outbox.Record{big, next})
	assert.Nil(t, errs, "a record Check takes is confirmed, and its key's next after it: %v", errs)
	assert.Zero(t, inject.calls.Load(), "no interceptor runs on the outbox's records")
	assert.Len(t, base.Producer.Interceptors, 1, "the caller's configuration is not modified")
}
