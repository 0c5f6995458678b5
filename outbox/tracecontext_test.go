package outbox_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceco/once/outbox"
)

// A service that installed no propagator (OpenTelemetry's global one is a
// no-op until it does) still has its writer's trace context stored with
// the row, as W3C traceparent: Add promises it, and the consumer of the
// next hop reads a traceparent header without a propagator too.
func TestTraceContextIsStoredWithoutAGlobalPropagator(t *testing.T) {
	usePropagator(t, propagation.NewCompositeTextMapPropagator()) // injects nothing, as the default

	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}))

	store, err := outbox.New(outbox.Config{})
	require.NoError(t, err)
	_, args, err := store.Statement(ctx, outbox.Message{Topic: "t", Body: []byte("b")})
	require.NoError(t, err)
	traces, ok := args[6].([][]byte)
	require.True(t, ok, "the seventh argument is the rows' trace contexts")
	var tc map[string]string
	require.NoError(t, json.Unmarshal(traces[0], &tc))
	assert.Equal(t, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", tc["traceparent"])

	// A context without a span stores none.
	_, args, err = store.Statement(context.Background(), outbox.Message{Topic: "t"})
	require.NoError(t, err)
	assert.JSONEq(t, `{}`, string(args[6].([][]byte)[0]))
}

// With no propagator installed (OpenTelemetry's default), the relay's
// batch span is still linked to the span that wrote the row: Add stored
// the writer's context as W3C traceparent, and the relay reads it back the
// way it was stored, as the next hop's consumer does.
func TestRelaySpanLinksToTheWritersWithoutAGlobalPropagator(t *testing.T) {
	usePropagator(t, propagation.NewCompositeTextMapPropagator()) // injects and extracts nothing, as the default
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	ctx, writer := tp.Tracer("handler").Start(context.Background(), "handle order.paid")
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return outbox.Add(ctx, tx, d.msg("a", "a/1")) }))
	writer.End()

	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, TracerProvider: tp})
	d.read(t, 1)
	publish := endedSpan(t, rec, "outbox publish")
	require.Len(t, publish.Links(), 1, "the batch span links to the row's writer")
	assert.Equal(t, writer.SpanContext().SpanID(), publish.Links()[0].SpanContext.SpanID())
}

// endedSpan waits for rec to hold an ended span named name and returns it.
func endedSpan(t *testing.T, rec *tracetest.SpanRecorder, name string) sdktrace.ReadOnlySpan {
	t.Helper()
	var found sdktrace.ReadOnlySpan
	require.Eventually(t, func() bool {
		for _, s := range rec.Ended() {
			if s.Name() == name {
				found = s
				return true
			}
		}
		return false
	}, 10*time.Second, 5*time.Millisecond)
	return found
}

// usePropagator sets the global propagator for the test, and puts the one
// before it back when the test ends: a propagator left set would hide,
// in the tests after it, what the default (a no-op) does.
func usePropagator(t *testing.T, p propagation.TextMapPropagator) {
	prev := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(p)
	t.Cleanup(func() { otel.SetTextMapPropagator(prev) })
}
