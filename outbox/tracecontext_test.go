package outbox_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceco/once/outbox"
)

// A service that installed no propagator (OpenTelemetry's global one is a
// no-op until it does) still has its writer's trace context stored with
// the row, as W3C traceparent: Add promises it, and the consumer of the
// next hop reads a traceparent header without a propagator too.
func TestTraceContextIsStoredWithoutAGlobalPropagator(t *testing.T) {
	prev := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator()) // injects nothing, as the default
	t.Cleanup(func() { otel.SetTextMapPropagator(prev) })

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
