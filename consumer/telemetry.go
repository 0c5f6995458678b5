package consumer

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

const instrumentationName = "github.com/onceco/once/consumer"

// Stats are the consumer's counters since New. Read them with
// Consumer.Stats; they are the same figures the metrics export.
type Stats struct {
	// Received counts deliveries taken from the source.
	Received uint64
	// Handled counts messages whose handler's transaction committed.
	Handled uint64
	// Duplicates counts messages skipped because their id was processed.
	Duplicates uint64
	// Skipped counts messages recorded without a handler (an unknown type
	// under SkipUnknownTypes, an id conflict under SkipConflicts, an event
	// a Hooks.Middleware returned nil for without calling next).
	Skipped uint64
	// DeadLettered counts dead-letter copies written (confirmed by the
	// dead-letter destination). Dead letters are at least once: a message
	// whose ack is lost after its copy was written comes again, is
	// dead-lettered again, and counts twice.
	DeadLettered uint64
	// Retries counts handler attempts after the first, decodings after a
	// Decoder's, Envelope's or Identify.EventID's RetryAfter, and retries
	// after infrastructure failures.
	Retries uint64
	// InfraErrors counts infrastructure failures (database or broker).
	InfraErrors uint64
	// StuckCalls counts calls the consumer does not cut (a hook, the
	// Decoder, Identify.EventID, Envelope or Fingerprint, a Source's or
	// Delivery's Ack, DeadLetter, RecordProgress or FirstPositionDone, a
	// send of the statements handlers queued with Event.Queue)
	// logged at Error for running past HandlerTimeout
	// (DefaultHandlerTimeout under NoHandlerTimeout), and handler calls
	// that ignored their context's end, logged at twice HandlerTimeout;
	// each such call counts once, however long it runs. The metric
	// once.consumer.stuck_calls counts them by function.
	StuckCalls uint64
}

type counters struct {
	received, handled, duplicates, skipped, deadLettered, retries, infraErrors, stuckCalls atomic.Uint64
}

func (c *counters) snapshot() Stats {
	return Stats{
		Received: c.received.Load(), Handled: c.handled.Load(), Duplicates: c.duplicates.Load(),
		Skipped: c.skipped.Load(), DeadLettered: c.deadLettered.Load(), Retries: c.retries.Load(),
		InfraErrors: c.infraErrors.Load(), StuckCalls: c.stuckCalls.Load(),
	}
}

type telemetry struct {
	tracer trace.Tracer
	// viaGlobal: the tracer came from the global provider
	// (Config.Telemetry.TracerProvider unset), so while no provider is
	// installed there the spans record nothing (startSpan).
	viaGlobal bool
	base      attribute.Set
	// baseOpt is base as a measurement option, built once; baseAdd and
	// baseRecord are it as the option slices the instruments take, so
	// that a measurement allocates no slice for its variadic options.
	baseOpt    metric.MeasurementOption
	baseAdd    []metric.AddOption
	baseRecord []metric.RecordOption
	// spanAttrs are the attributes every consumer span starts with, and
	// spanStart the start options carrying them, built once.
	spanAttrs []attribute.KeyValue
	spanStart []trace.SpanStartOption
	// spanNames caches "process <topic>" per topic.
	spanNames sync.Map
	// outcomes caches the add options ([]metric.AddOption) of each outcome.
	outcomes sync.Map

	messages, retries, deadLetters metric.Int64Counter
	stuckCalls                     metric.Int64Counter
	handlerDur, commitDur          metric.Float64Histogram
	inflight                       metric.Int64UpDownCounter
	batchSize                      metric.Int64Histogram

	// The OpenTelemetry messaging conventions' consumer metrics.
	consumed    metric.Int64Counter
	processDur  metric.Float64Histogram
	conventions attribute.Set
	// conventionOpts caches the measurement options per destination and
	// error type: a map under a lock, since a sync.Map would box the key
	// on every message.
	conventionMu   sync.RWMutex
	conventionOpts map[[2]string]measurementOpts
}

// measurementOpts is one attribute set as the option slices of counters
// and histograms.
type measurementOpts struct {
	add    []metric.AddOption
	record []metric.RecordOption
}

func newMeasurementOpts(set attribute.Set) measurementOpts {
	opt := metric.WithAttributeSet(set)
	return measurementOpts{add: []metric.AddOption{opt}, record: []metric.RecordOption{opt}}
}

// GroupNamer is implemented by sources that consume as a member of a
// broker-side consumer group (a Kafka consumer group): telemetry reports it
// as messaging.consumer.group.name. The consumer finds it by type
// assertion and asks it once, in New; a panic in it makes New fail with an
// error wrapping ErrSourceBroken. Without it the attribute is left out (RabbitMQ has no groups);
// the consumer's own name is always in once.consumer.
type GroupNamer interface {
	ConsumerGroup() string
}

// TelemetryAttributer is implemented by deliveries that know messaging
// attributes the consumer cannot derive from Message, such as RabbitMQ's
// destination, made of exchange, routing key and queue
// (messaging.destination.name), and its routing key
// (messaging.rabbitmq.destination.routing_key). They are added to the
// message's span, after and over the consumer's own. The consumer finds it
// by type assertion, and calls it only when the span records. A panic in
// it is caught: the span then carries once.telemetry_attributes.panic
// instead, and the message is handled.
type TelemetryAttributer interface {
	TelemetryAttributes() []attribute.KeyValue
}

func newTelemetry(cfg *Config, system, group string) (*telemetry, error) {
	tp, mp := cfg.Telemetry.TracerProvider, cfg.Telemetry.MeterProvider
	viaGlobal := tp == nil
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	m := mp.Meter(instrumentationName)
	t := &telemetry{
		tracer:    tp.Tracer(instrumentationName),
		viaGlobal: viaGlobal,
		base:      attribute.NewSet(attribute.String("once.consumer", cfg.Name), attribute.String("messaging.system", system)),
		spanAttrs: []attribute.KeyValue{
			attribute.String("messaging.system", system),
			attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.operation.name", "process"),
			attribute.String("once.consumer", cfg.Name),
		},
	}
	conventions := []attribute.KeyValue{
		attribute.String("messaging.system", system),
		attribute.String("messaging.operation.name", "process"),
	}
	if group != "" {
		t.spanAttrs = append(t.spanAttrs, attribute.String("messaging.consumer.group.name", group))
		conventions = append(conventions, attribute.String("messaging.consumer.group.name", group))
	}
	t.conventions = attribute.NewSet(conventions...)
	t.baseOpt = metric.WithAttributeSet(t.base)
	t.baseAdd, t.baseRecord = []metric.AddOption{t.baseOpt}, []metric.RecordOption{t.baseOpt}
	t.spanStart = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(t.spanAttrs...)}
	var err error
	if t.messages, err = m.Int64Counter("once.consumer.messages",
		metric.WithDescription("Messages settled, by outcome: handled, duplicate, skipped, dead_lettered."),
		metric.WithUnit("{message}")); err != nil {
		return nil, err
	}
	if t.retries, err = m.Int64Counter("once.consumer.retries",
		metric.WithDescription("Retries, by reason: handler or infrastructure."), metric.WithUnit("{retry}")); err != nil {
		return nil, err
	}
	if t.deadLetters, err = m.Int64Counter("once.consumer.dead_letters",
		metric.WithDescription("Dead-letter copies written, by error kind (a message whose ack was lost after its copy was written counts twice)."), metric.WithUnit("{message}")); err != nil {
		return nil, err
	}
	if t.stuckCalls, err = m.Int64Counter("once.consumer.stuck_calls",
		metric.WithDescription("Calls past HandlerTimeout of functions the consumer does not cut (hooks, Decoder, Identify, Envelope, a custom Source's Ack, DeadLetter, RecordProgress, FirstPositionDone), and handlers past twice HandlerTimeout, by function; each counts once, however long it runs."),
		metric.WithUnit("{call}")); err != nil {
		return nil, err
	}
	if t.handlerDur, err = m.Float64Histogram("once.consumer.handler.duration",
		metric.WithDescription("Time in the handler, per attempt."), metric.WithUnit("s")); err != nil {
		return nil, err
	}
	if t.commitDur, err = m.Float64Histogram("once.consumer.commit.duration",
		metric.WithDescription("Time to commit the handler's transaction."), metric.WithUnit("s")); err != nil {
		return nil, err
	}
	if t.inflight, err = m.Int64UpDownCounter("once.consumer.inflight",
		metric.WithDescription("Messages being handled now."), metric.WithUnit("{message}")); err != nil {
		return nil, err
	}
	if t.batchSize, err = m.Int64Histogram("once.consumer.batch.size",
		metric.WithDescription("Messages per batch transaction."), metric.WithUnit("{message}")); err != nil {
		return nil, err
	}
	if t.consumed, err = m.Int64Counter("messaging.client.consumed.messages",
		metric.WithDescription("Number of messages that were delivered to the application."),
		metric.WithUnit("{message}")); err != nil {
		return nil, err
	}
	if t.processDur, err = m.Float64Histogram("messaging.process.duration",
		metric.WithDescription("Duration of processing operation."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)); err != nil {
		return nil, err
	}
	return t, nil
}

// conventionOpt returns the measurement option of the conventions' metrics
// for a destination and an error type ("" when the processing succeeded).
func (t *telemetry) conventionOpt(destination, errorType string) measurementOpts {
	key := [2]string{destination, errorType}
	t.conventionMu.RLock()
	opt, ok := t.conventionOpts[key]
	t.conventionMu.RUnlock()
	if ok {
		return opt
	}
	attrs := append(t.conventions.ToSlice(), attribute.String("messaging.destination.name", destination))
	if errorType != "" {
		attrs = append(attrs, attribute.String("error.type", errorType))
	}
	opt = newMeasurementOpts(attribute.NewSet(attrs...))
	t.conventionMu.Lock()
	if t.conventionOpts == nil {
		t.conventionOpts = map[[2]string]measurementOpts{}
	}
	t.conventionOpts[key] = opt
	t.conventionMu.Unlock()
	return opt
}

// received counts a delivery handed to the application.
func (t *telemetry) received(ctx context.Context, m *Message) {
	t.consumed.Add(ctx, 1, t.conventionOpt(m.Topic, "").add...)
}

// processed records how long a message took from its span's start to its
// settlement; errorType is set when it was dead-lettered.
func (t *telemetry) processed(ctx context.Context, m *Message, start time.Time, errorType string) {
	t.processDur.Record(ctx, time.Since(start).Seconds(), t.conventionOpt(m.Topic, errorType).record...)
}

// startSpan starts the consumer span of m, as a child of the producer's
// context when m carries one (extractParent), else as the root of a trace
// of its own: never as a child of a span in ctx (withoutSpan). The
// message's own attributes are built only when the span records: with no
// tracer installed (the no-op provider) or a sampler that drops the span,
// this runs for every message and nothing would read them. A sampler sees
// the consumer's attributes (system, operation, consumer, group) at the
// start.
func (t *telemetry) startSpan(ctx context.Context, dv Delivery, m *Message) (context.Context, trace.Span) {
	ctx = withoutSpan(ctx)
	if len(m.Headers) > 0 {
		ctx = extractParent(ctx, propagation.MapCarrier(m.Headers))
	}
	if t.viaGlobal && noGlobalTracing() {
		// No provider installed: the global tracer would return a span
		// that records nothing and carries the parent's span context, at
		// three allocations a message. The parent itself is such a span
		// (or none), and ctx already carries its span context.
		if parent := trace.SpanFromContext(ctx); !parent.IsRecording() {
			return ctx, parent
		}
	}
	ctx, span := t.tracer.Start(ctx, t.spanName(m.Topic), t.spanStart...)
	if !span.IsRecording() {
		return ctx, span
	}
	attrs := make([]attribute.KeyValue, 0, 3)
	attrs = append(attrs, attribute.String("messaging.destination.name", m.Topic))
	if m.Partition >= 0 {
		attrs = append(attrs, attribute.String("messaging.destination.partition.id", strconv.FormatInt(int64(m.Partition), 10)))
	}
	if m.Offset >= 0 {
		attrs = append(attrs, attribute.Int64("messaging.kafka.offset", m.Offset))
	}
	if ta, ok := dv.(TelemetryAttributer); ok {
		attrs = append(attrs, sourceAttributes(ta)...)
	}
	span.SetAttributes(attrs...)
	return ctx, span
}

// withoutSpan returns ctx without the span it carries, if any. ctx comes
// from Run's, which may carry a span (a service that starts its consumer
// inside a start-up span), and that span is no message's parent: left
// there, every message without a trace context became its child, one
// trace for the process's life, and it hid the producer's traceparent
// (extractParent took the span it found in ctx for the one the global
// propagator, a no-op by default, read from the headers). ctx's values
// and cancellation are kept; a ctx without a span is returned as it is,
// at no cost.
func withoutSpan(ctx context.Context) context.Context {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return ctx
	}
	return trace.ContextWithSpanContext(ctx, trace.SpanContext{})
}

// sourceAttributes returns ta's attributes. A custom Source's method runs
// here, before the guarded stage that catches the panics of user
// functions, on every message: a panic leaves the span without the
// source's attributes, and with once.telemetry_attributes.panic saying
// why, rather than crash the process.
func sourceAttributes(ta TelemetryAttributer) (attrs []attribute.KeyValue) {
	defer func() {
		if r := recover(); r != nil {
			attrs = []attribute.KeyValue{attribute.String("once.telemetry_attributes.panic", fmt.Sprint(r))}
		}
	}()
	return ta.TelemetryAttributes()
}

// defaultTracerProvider is the global tracer provider before any is
// installed: OpenTelemetry's delegating one, whose spans record nothing
// until otel.SetTracerProvider replaces it (GetTracerProvider then returns
// the new one). Nil if another package installed a provider before this
// one was initialised, which only turns the shortcut of startSpan off.
var defaultTracerProvider = func() trace.TracerProvider {
	tp := otel.GetTracerProvider()
	if fmt.Sprintf("%T", tp) != "*global.tracerProvider" {
		return nil
	}
	return tp
}()

// noGlobalTracing reports whether the global tracer provider is still
// OpenTelemetry's default, with no provider installed.
func noGlobalTracing() bool {
	return defaultTracerProvider != nil && otel.GetTracerProvider() == defaultTracerProvider
}

// extractParent returns ctx with the producer's span context from the
// headers: read with the global propagator (otel.SetTextMapPropagator: B3,
// Jaeger, W3C with baggage...), or, when that finds none (the global
// propagator is a no-op until a service sets one), from a W3C traceparent
// header.
func extractParent(ctx context.Context, carrier propagation.MapCarrier) context.Context {
	if c := otel.GetTextMapPropagator().Extract(ctx, carrier); trace.SpanContextFromContext(c).IsValid() {
		return c
	}
	return propagation.TraceContext{}.Extract(ctx, carrier)
}

func (t *telemetry) spanName(topic string) string {
	if name, ok := t.spanNames.Load(topic); ok {
		return name.(string)
	}
	name := "process " + topic
	t.spanNames.Store(topic, name)
	return name
}

func (t *telemetry) traceParent(ctx context.Context) string {
	carrier := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, carrier)
	return carrier["traceparent"]
}

func (t *telemetry) outcome(ctx context.Context, span trace.Span, outcome string) {
	if span.IsRecording() {
		span.SetAttributes(attribute.String("once.outcome", outcome))
	}
	opts, ok := t.outcomes.Load(outcome)
	if !ok {
		opts = newMeasurementOpts(attribute.NewSet(append(t.base.ToSlice(), attribute.String("outcome", outcome))...)).add
		t.outcomes.Store(outcome, opts)
	}
	t.messages.Add(ctx, 1, opts.([]metric.AddOption)...)
}

func (t *telemetry) retry(ctx context.Context, reason string) {
	t.retries.Add(ctx, 1, metric.WithAttributeSet(t.base), metric.WithAttributes(attribute.String("reason", reason)))
}

func (t *telemetry) deadLetter(ctx context.Context, span trace.Span, kind ErrorKind, msg string) {
	span.SetStatus(codes.Error, msg)
	span.RecordError(errors.New(msg), trace.WithAttributes(attribute.String("error.type", string(kind))))
	span.SetAttributes(attribute.String("error.type", string(kind)))
	t.deadLetters.Add(ctx, 1, metric.WithAttributeSet(t.base), metric.WithAttributes(attribute.String("kind", string(kind))))
}

// stuck counts a call of function past the watchdog's bound (watch.go).
func (t *telemetry) stuck(ctx context.Context, function string) {
	t.stuckCalls.Add(ctx, 1, metric.WithAttributeSet(t.base), metric.WithAttributes(attribute.String("once.function", function)))
}

func (t *telemetry) since(ctx context.Context, h metric.Float64Histogram, start time.Time) {
	h.Record(ctx, time.Since(start).Seconds(), t.baseRecord...)
}
