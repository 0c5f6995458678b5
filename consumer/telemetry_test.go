package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/oncetest"
)

// groupSource is a memsource Source that consumes as a member of a
// broker-side group, as the Kafka source does.
type groupSource struct{ *memsource.Source }

func (groupSource) ConsumerGroup() string { return "orders-group" }

const parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// Spans and metrics follow the OpenTelemetry messaging conventions, read
// back with the SDK's in-memory exporters.
func TestTelemetryFollowsTheMessagingConventions(t *testing.T) {
	pool := oncetest.Postgres(t)
	spans := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))

	b := memsource.New(memsource.Options{Topic: "orders", Streams: 1})
	v, _ := json.Marshal(order{N: 1})
	b.Publish(consumer.Message{Value: v, Key: []byte("k"), Headers: map[string]string{"id": "good", "traceparent": parent}})
	b.Publish(consumer.Message{Value: []byte("{not json"), Key: []byte("k"), Headers: map[string]string{"id": "bad"}})
	cfg := consumer.Config{Name: "billing", Telemetry: consumer.TelemetryConfig{TracerProvider: tp, MeterProvider: mp}}
	noop := func(context.Context, pgx.Tx, consumer.Event[order]) error { return nil }
	c, err := consumer.New(pool, groupSource{b.Source()}, noop, cfg)
	require.NoError(t, err)
	oncetest.Drain(t, c, b)

	got := map[string]tracetest.SpanStub{}
	for _, s := range spans.GetSpans() {
		id, _ := attrOf(s.Attributes, "messaging.message.id")
		got[id.AsString()] = s
	}
	require.Contains(t, got, "good")
	require.Contains(t, got, "bad")
	good, bad := got["good"], got["bad"]
	assert.Equal(t, "process orders", good.Name)
	for key, want := range map[string]string{
		"messaging.system": "memory", "messaging.operation.name": "process", "messaging.operation.type": "process",
		"messaging.destination.name": "orders", "messaging.consumer.group.name": "orders-group", "once.consumer": "billing",
	} {
		v, ok := attrOf(good.Attributes, key)
		assert.True(t, ok, key)
		assert.Equal(t, want, v.AsString(), key)
	}
	assert.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", good.Parent.TraceID().String(), "the producer's trace is the parent")
	assert.Equal(t, codes.Error, bad.Status.Code)
	errType, _ := attrOf(bad.Attributes, "error.type")
	assert.Equal(t, "decode", errType.AsString())
	require.NotEmpty(t, bad.Events, "the error is recorded on the span")
	assert.Equal(t, "exception", bad.Events[0].Name)

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	consumed, processed := int64(0), map[string]uint64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch m.Name {
			case "messaging.client.consumed.messages":
				for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
					consumed += dp.Value
				}
			case "messaging.process.duration":
				for _, dp := range m.Data.(metricdata.Histogram[float64]).DataPoints {
					et, _ := dp.Attributes.Value("error.type")
					processed[et.AsString()] += dp.Count
				}
			}
		}
	}
	assert.Equal(t, int64(2), consumed)
	assert.Equal(t, map[string]uint64{"": 1, "decode": 1}, processed)
}

// testPropagator reads a trace id from the x-test-trace header: a
// propagator other than W3C's, as B3 or Jaeger's are.
type testPropagator struct{}

func (testPropagator) Inject(context.Context, propagation.TextMapCarrier) {}
func (testPropagator) Fields() []string                                   { return []string{"x-test-trace"} }
func (testPropagator) Extract(ctx context.Context, c propagation.TextMapCarrier) context.Context {
	tid, err := trace.TraceIDFromHex(c.Get("x-test-trace"))
	if err != nil {
		return ctx
	}
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: trace.SpanID{1}, TraceFlags: trace.FlagsSampled, Remote: true})
	return trace.ContextWithRemoteSpanContext(ctx, sc)
}

// The consumer extracts the producer's context with the global propagator,
// so a service that sets another one (B3, Jaeger) is understood; W3C's
// traceparent is read when the global one finds nothing.
func TestTelemetryUsesTheGlobalPropagator(t *testing.T) {
	previous := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(testPropagator{})
	t.Cleanup(func() { otel.SetTextMapPropagator(previous) })
	pool := oncetest.Postgres(t)
	spans := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))
	b := memsource.New(memsource.Options{})
	v, _ := json.Marshal(order{N: 1})
	const other = "11111111111111111111111111111111"
	b.Publish(consumer.Message{Value: v, Headers: map[string]string{"id": "global", "traceparent": parent, "x-test-trace": other}})
	b.Publish(consumer.Message{Value: v, Headers: map[string]string{"id": "w3c", "traceparent": parent}})
	noop := func(context.Context, pgx.Tx, consumer.Event[order]) error { return nil }
	c, err := consumer.New(pool, b.Source(), noop, consumer.Config{Name: "billing", Telemetry: consumer.TelemetryConfig{TracerProvider: tp}})
	require.NoError(t, err)
	oncetest.Drain(t, c, b)
	parents := map[string]string{}
	for _, s := range spans.GetSpans() {
		id, _ := attrOf(s.Attributes, "messaging.message.id")
		parents[id.AsString()] = s.Parent.TraceID().String()
	}
	assert.Equal(t, map[string]string{"global": other, "w3c": "4bf92f3577b34da6a3ce929d0e0e4736"}, parents)
}

func attrOf(attrs []attribute.KeyValue, key string) (attribute.Value, bool) {
	for _, a := range attrs {
		if string(a.Key) == key {
			return a.Value, true
		}
	}
	return attribute.Value{}, false
}

// A dead-letter copy carries the traceparent of the consumer span that
// dead-lettered it, whatever the failure: a message that could not be
// decoded, a handler's permanent failure, a handler out of attempts. The
// OnRetry hook and the logs get the message's context, with its span.
func TestDeadLetterCarriesTheConsumerSpansTraceParent(t *testing.T) {
	pool := oncetest.Postgres(t)
	spans := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))
	b := memsource.New(memsource.Options{Topic: "orders", Streams: 1})
	v, _ := json.Marshal(order{N: 1})
	for _, id := range []string{"permanent", "exhausted"} {
		b.Publish(consumer.Message{Value: v, Key: []byte("k"), Headers: map[string]string{"id": id, "traceparent": parent}})
	}
	b.Publish(consumer.Message{Value: []byte("{not json"), Key: []byte("k"), Headers: map[string]string{"id": "undecodable", "traceparent": parent}})
	retried := map[string]bool{}
	cfg := consumer.Config{Name: "billing", Telemetry: consumer.TelemetryConfig{TracerProvider: tp},
		Retry: consumer.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond},
		Hooks: consumer.Hooks{OnRetry: func(ctx context.Context, r consumer.Retry) {
			retried[r.EventID] = trace.SpanContextFromContext(ctx).TraceID().String() == "4bf92f3577b34da6a3ce929d0e0e4736"
		}}}
	h := func(_ context.Context, _ pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "permanent" {
			return consumer.Permanent(errors.New("invalid order"))
		}
		return errors.New("failing")
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	oncetest.Drain(t, c, b)

	spanOf := map[string]string{}
	for _, s := range spans.GetSpans() {
		id, _ := attrOf(s.Attributes, "messaging.message.id")
		spanOf[id.AsString()] = s.SpanContext.SpanID().String()
	}
	got := map[string]string{}
	for _, dl := range b.DeadLetters() {
		id := dl.Headers[consumer.HeaderEventID]
		require.NotEmpty(t, spanOf[id], id)
		got[id] = dl.Headers[consumer.HeaderTraceParent]
	}
	want := map[string]string{}
	for id, span := range spanOf {
		want[id] = "00-4bf92f3577b34da6a3ce929d0e0e4736-" + span + "-01"
	}
	assert.Equal(t, want, got)
	assert.Equal(t, map[string]bool{"exhausted": true}, retried, "OnRetry gets the message's span")
}
