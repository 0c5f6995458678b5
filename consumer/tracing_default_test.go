package consumer

import (
	"context"
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceco/once/internal/pgtest"
)

// With no tracer provider installed a message's span costs nothing: the
// global tracer's spans would record nothing, and the consumer makes none.
// The producer's span context still reaches the handler's context. (The
// default global provider is recognised by its type: an OpenTelemetry
// release that renames it fails here instead of allocating again unseen.)
func TestSpanWithoutAProviderAllocatesNothing(t *testing.T) {
	require.NotNil(t, defaultTracerProvider, "OpenTelemetry's default global provider is recognised")
	require.True(t, noGlobalTracing(), "no test of this package installs a global provider")
	cfg, err := Config{Name: "tracing"}.withDefaults()
	require.NoError(t, err)
	tel, err := newTelemetry(&cfg, "kafka", "group")
	require.NoError(t, err)

	traced := &Message{Topic: "orders", Partition: 1, Offset: 2,
		Headers: map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}
	ctx, span := tel.startSpan(context.Background(), nil, traced)
	assert.False(t, span.IsRecording())
	assert.Equal(t, "0af7651916cd43dd8448eb211c80319c", trace.SpanContextFromContext(ctx).TraceID().String(),
		"the producer's trace reaches the handler")

	plain := &Message{Topic: "orders", Partition: 1, Offset: 2}
	allocs := testing.AllocsPerRun(100, func() {
		_, span := tel.startSpan(context.Background(), nil, plain)
		span.End()
	})
	assert.Zero(t, allocs)
}

// A provider installed after the consumer was built records its spans from
// then on, as OpenTelemetry's global tracer promises. Run in a process of
// its own: a global provider cannot be uninstalled.
func TestProviderInstalledLaterRecords(t *testing.T) {
	if os.Getenv("ONCE_TEST_LATE_PROVIDER") == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestProviderInstalledLaterRecords$", "-test.count=1")
		cmd.Env = append(os.Environ(), "ONCE_TEST_LATE_PROVIDER=1", "DATABASE_URL="+pgtest.URL())
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s", out)
		require.Contains(t, string(out), "PASS")
		return
	}
	cfg, err := Config{Name: "tracing"}.withDefaults()
	require.NoError(t, err)
	tel, err := newTelemetry(&cfg, "kafka", "group")
	require.NoError(t, err)
	m := &Message{Topic: "orders", Partition: 1, Offset: 2}
	_, span := tel.startSpan(context.Background(), nil, m)
	require.False(t, span.IsRecording(), "no provider yet")

	rec := tracetest.NewSpanRecorder()
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	require.False(t, noGlobalTracing())
	_, span = tel.startSpan(context.Background(), nil, m)
	require.True(t, span.IsRecording(), "the installed provider's span")
	span.End()
	require.Len(t, rec.Ended(), 1)
	assert.Equal(t, "process orders", rec.Ended()[0].Name())
}
