package consumer_test

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/oncetest"
)

// panickyAttributesSource hands out deliveries whose TelemetryAttributes
// panics, as a custom Source's might.
type panickyAttributesSource struct{ consumer.Source }

func (s panickyAttributesSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return panickyAttributesDelivery{d}, nil
}

type panickyAttributesDelivery struct{ consumer.Delivery }

func (panickyAttributesDelivery) TelemetryAttributes() []attribute.KeyValue {
	panic("the source's attributes")
}

// A delivery's TelemetryAttributes runs when the message's span starts,
// before the guarded stage that catches panics of user functions: with a
// recording tracer, a panic there crashed the process on every delivery.
// The span goes without the source's attributes, says so, and the message
// is handled.
func TestPanickingTelemetryAttributesCrashNothing(t *testing.T) {
	pool := oncetest.Postgres(t)
	spans := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))
	b := memsource.New(memsource.Options{Topic: "orders", Streams: 1})
	v, _ := json.Marshal(order{N: 1})
	b.Publish(consumer.Message{Value: v, Headers: map[string]string{"id": "e1"}})
	var handled atomic.Int32
	h := func(context.Context, pgx.Tx, consumer.Event[order]) error { handled.Add(1); return nil }
	c, err := consumer.New(pool, panickyAttributesSource{b.Source()}, h,
		consumer.Config{Name: "billing", Telemetry: consumer.TelemetryConfig{TracerProvider: tp}})
	require.NoError(t, err)
	oncetest.Drain(t, c, b)
	assert.Equal(t, int32(1), handled.Load())
	require.NotEmpty(t, spans.GetSpans())
	got, ok := attrOf(spans.GetSpans()[0].Attributes, "once.telemetry_attributes.panic")
	require.True(t, ok, "the span says the source's attributes panicked")
	assert.Equal(t, "the source's attributes", got.AsString())
}
