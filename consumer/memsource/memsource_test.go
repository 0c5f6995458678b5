package memsource_test

import (
	"bytes"
	"context"
	"maps"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/conformance"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// broker adapts a memsource.Broker to the conformance suite.
type broker struct{ b *memsource.Broker }

func (b broker) Publish(_ context.Context, msgs ...conformance.OutMessage) error {
	for _, m := range msgs {
		h := maps.Clone(m.Headers)
		if h == nil {
			h = map[string]string{}
		}
		if m.ID != "" {
			h["id"] = m.ID
		}
		if m.Type != "" {
			h["type"] = m.Type
		}
		b.b.Publish(consumer.Message{Key: m.Key, Value: m.Value, Headers: h})
	}
	return nil
}

func (b broker) NewSource(*testing.T) consumer.Source { return b.b.Source() }

func (b broker) DeadLetters(context.Context) ([]conformance.DeadLetterRecord, error) {
	var out []conformance.DeadLetterRecord
	for _, d := range b.b.DeadLetters() {
		out = append(out, conformance.DeadLetterRecord{Key: d.Message.Key, Value: d.Message.Value, Headers: d.Headers})
	}
	return out, nil
}

func TestConformanceOrdered(t *testing.T) {
	conformance.Run(t, conformance.Suite{
		Features: conformance.Features{Ordered: true, FallbackID: true, RedeliverOnRestart: true},
		NewBroker: func(t *testing.T) conformance.Broker {
			return broker{memsource.New(memsource.Options{Streams: 4, FallbackID: true})}
		},
		NewDB: func(t *testing.T) *pgxpool.Pool { p, _ := pgtest.Schema(t); return p },
	})
}

func TestConformanceOneMessagePerTransaction(t *testing.T) {
	conformance.Run(t, conformance.Suite{
		Features: conformance.Features{Ordered: true, FallbackID: true, RedeliverOnRestart: true},
		NewBroker: func(t *testing.T) conformance.Broker {
			return broker{memsource.New(memsource.Options{Streams: 4, FallbackID: true})}
		},
		NewDB: func(t *testing.T) *pgxpool.Pool { p, _ := pgtest.Schema(t); return p },
		Tune:  func(c *consumer.Config) { c.Batch.Size = 1 },
	})
}

func TestConformanceUnordered(t *testing.T) {
	conformance.Run(t, conformance.Suite{
		Features:  conformance.Features{RedeliverOnRestart: true},
		NewBroker: func(t *testing.T) conformance.Broker { return broker{memsource.New(memsource.Options{})} },
		NewDB:     func(t *testing.T) *pgxpool.Pool { p, _ := pgtest.Schema(t); return p },
	})
}

// Publish keeps its own copy of the key and value, as a broker does once a
// publish returns: the caller may reuse its buffers for the next message.
func TestPublishCopiesKeyAndValue(t *testing.T) {
	b := memsource.New(memsource.Options{Streams: 2})
	var buf bytes.Buffer
	for _, v := range []string{`{"n":1}`, `{"n":2}`} {
		buf.Reset()
		buf.WriteString(v)
		key := buf.Bytes()[:6] // shares buf's array too
		b.Publish(consumer.Message{Key: key, Value: buf.Bytes()})
	}
	src := b.Source()
	defer src.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var got []string
	for range 2 {
		d, err := src.Receive(ctx)
		require.NoError(t, err)
		got = append(got, string(d.Message().Key)+" "+string(d.Message().Value))
	}
	assert.ElementsMatch(t, []string{`{"n":1 {"n":1}`, `{"n":2 {"n":2}`}, got)
}

// Each delivery is a copy, as a real broker's is: what a handler does to
// its message (a header set, a value changed in place) is not in the
// broker's log, nor in a redelivery, nor in the dead letter.
func TestDeliveriesAreCopies(t *testing.T) {
	b := memsource.New(memsource.Options{})
	b.Publish(consumer.Message{Value: []byte(`{"n":1}`), Headers: map[string]string{"id": "e1"}})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	src := b.Source()
	d, err := src.Receive(ctx)
	require.NoError(t, err)
	d.Message().Headers["id"] = "changed"
	d.Message().Value[2] = 'x'
	require.NoError(t, src.Close())

	src = b.Source()
	defer src.Close()
	d, err = src.Receive(ctx)
	require.NoError(t, err)
	assert.Equal(t, "e1", d.Message().Headers["id"])
	assert.Equal(t, `{"n":1}`, string(d.Message().Value))

	// The dead letter is the message as published, as Kafka's copy is
	// made from the record it read, whatever the handler did to its
	// delivery; the diagnostic headers are the consumer's.
	d.Message().Headers["id"] = "changed"
	d.Message().Headers["added"] = "by the handler"
	d.Message().Value[2] = 'x'
	require.NoError(t, d.DeadLetter(ctx, &consumer.DeadLetter{Kind: consumer.KindHandler, EventID: "e1"}))
	dead := b.DeadLetters()
	require.Len(t, dead, 1)
	assert.Equal(t, `{"n":1}`, string(dead[0].Message.Value))
	assert.Equal(t, map[string]string{"id": "e1"}, dead[0].Message.Headers)
	assert.Equal(t, "e1", dead[0].Headers["id"])
	assert.NotContains(t, dead[0].Headers, "added")
	assert.Equal(t, string(consumer.KindHandler), dead[0].Headers[consumer.HeaderErrorKind])
}

// A delivery of a closed Source cannot be dead-lettered, as with the real
// adapters: a test on memsource must not pass where Kafka or RabbitMQ
// would refuse.
func TestDeadLetterAfterCloseFails(t *testing.T) {
	b := memsource.New(memsource.Options{})
	b.Publish(consumer.Message{ID: "e1", Value: []byte(`{}`)})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	src := b.Source()
	d, err := src.Receive(ctx)
	require.NoError(t, err)
	require.NoError(t, src.Close())
	require.Error(t, d.DeadLetter(ctx, &consumer.DeadLetter{Kind: consumer.KindHandler}))
	assert.Empty(t, b.DeadLetters())
}

// Publish sets where a message is, whatever the caller's copy said: a
// message copied from a delivery (republished in a test) kept its Stream
// on a broker without streams, and was handled in order, on a stream the
// broker does not have, though the doc says Publish sets it.
func TestPublishSetsTheStream(t *testing.T) {
	ctx := context.Background()
	b := memsource.New(memsource.Options{})
	b.Publish(consumer.Message{Value: []byte(`{}`), Stream: "orders/3", Partition: 3})
	d, err := b.Source().Receive(ctx)
	require.NoError(t, err)
	assert.Empty(t, d.Message().Stream, "a broker without streams delivers on none")
	assert.EqualValues(t, -1, d.Message().Partition)
}
