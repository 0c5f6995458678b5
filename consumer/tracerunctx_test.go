package consumer_test

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/oncetest"
)

// A span in Run's context (a service that starts its consumer inside a
// start-up span) is no message's parent: a message carrying the producer's
// traceparent continues the producer's trace, with no global propagator
// set as with one, and a message carrying none starts a trace of its own,
// rather than every message of the process's life joining the start-up
// trace.
func TestRunsContextSpanIsNoMessagesParent(t *testing.T) {
	pool := oncetest.Postgres(t)
	spans := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))
	b := memsource.New(memsource.Options{Topic: "orders", Streams: 1})
	v, _ := json.Marshal(order{N: 1})
	b.Publish(consumer.Message{Value: v, Key: []byte("k"), Headers: map[string]string{"id": "traced", "traceparent": parent}})
	b.Publish(consumer.Message{Value: v, Key: []byte("k"), Headers: map[string]string{"id": "untraced"}})

	var mu sync.Mutex
	handlerTrace := map[string]string{}
	h := func(ctx context.Context, _ pgx.Tx, ev consumer.Event[order]) error {
		mu.Lock()
		handlerTrace[ev.ID] = trace.SpanContextFromContext(ctx).TraceID().String()
		mu.Unlock()
		return nil
	}
	c, err := consumer.New(pool, b.Source(), h, consumer.Config{Name: "billing", Telemetry: consumer.TelemetryConfig{TracerProvider: tp}})
	require.NoError(t, err)

	runCtx, startup := tp.Tracer("service").Start(context.Background(), "service start")
	runCtx, stop := context.WithCancel(runCtx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	wait, cancelWait := context.WithTimeout(context.Background(), time.Minute)
	defer cancelWait()
	require.NoError(t, b.WaitEachAcked(wait, 2))
	stop()
	require.NoError(t, <-done)
	startup.End()

	startupTrace := startup.SpanContext().TraceID().String()
	messageSpans := map[string]tracetest.SpanStub{}
	for _, s := range spans.GetSpans() {
		if id, ok := attrOf(s.Attributes, "messaging.message.id"); ok {
			messageSpans[id.AsString()] = s
		}
	}
	require.Contains(t, messageSpans, "traced")
	require.Contains(t, messageSpans, "untraced")
	traced, untraced := messageSpans["traced"], messageSpans["untraced"]
	assert.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", traced.Parent.TraceID().String(), "the producer's span is the parent")
	assert.Equal(t, "00f067aa0ba902b7", traced.Parent.SpanID().String(), "the producer's span is the parent")
	assert.False(t, untraced.Parent.IsValid(), "a message without a trace context starts a trace, not a child of Run's span")
	assert.NotEqual(t, startupTrace, untraced.SpanContext.TraceID().String())
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", handlerTrace["traced"], "the handler runs in the producer's trace")
	assert.NotEqual(t, startupTrace, handlerTrace["untraced"], "the handler does not run in Run's trace")
}
