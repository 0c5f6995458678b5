package outbox

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Metric names of the relay.
const (
	// PublishedMetric counts rows the broker confirmed.
	PublishedMetric = "once.outbox.published"
	// RejectedMetric counts refusals charged to rows (parking included).
	RejectedMetric = "once.outbox.rejected"
	// ParkedMetric counts rows parked.
	ParkedMetric = "once.outbox.parked"
	// FailuresMetric counts batches that failed for the broker or the
	// database being unavailable, each followed by a backoff.
	FailuresMetric = "once.outbox.failures"
	// RefusalsMetric counts the batches of those failures in which the
	// broker refused the publisher itself (credentials, permissions, TLS
	// or SASL settings: an error wrapped with Refused), which do not pass
	// without a fix on the broker's side or the publisher's.
	RefusalsMetric = "once.outbox.refusals"
	// StalledMetric is 1 while the relay has given up a call to the
	// publisher that has not returned (RelayConfig.PublishTimeout), and
	// does not lead until it does; else 0.
	StalledMetric = "once.outbox.stalled"
	// LeaderMetric is 1 while the relay leads, else 0.
	LeaderMetric = "once.outbox.leader"
)

// relayMetrics are the relay's instruments; every measurement carries the
// table's name.
type relayMetrics struct {
	published, rejected, parked, failures, refusals metric.Int64Counter
	attrs                                           metric.MeasurementOption
	// meter made leaderGauge and stalledGauge, whose callback start
	// registers.
	meter                     metric.Meter
	leaderGauge, stalledGauge metric.Int64ObservableGauge
	// gauges is the callback of LeaderMetric and StalledMetric, which
	// holds the relay: registered while Run runs only (start, stop), so
	// that the meter provider, often the process's global one, does not
	// keep every relay ever made, nor report the gauges of relays stopped
	// or never run (a relay built and not run reported leader 0 under the
	// table of the one that leads, and hid its 1).
	gauges metric.Registration
}

func newRelayMetrics(mp metric.MeterProvider, table string) (*relayMetrics, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	m := mp.Meter(instrumentationName)
	rm := &relayMetrics{attrs: metric.WithAttributeSet(attribute.NewSet(attribute.String("once.outbox.table", table)))}
	var err error
	counter := func(name, desc string) metric.Int64Counter {
		if err != nil {
			return nil
		}
		var c metric.Int64Counter
		c, err = m.Int64Counter(name, metric.WithDescription(desc), metric.WithUnit("{row}"))
		return c
	}
	rm.published = counter(PublishedMetric, "Outbox rows the broker confirmed.")
	rm.rejected = counter(RejectedMetric, "Outbox rows the broker refused (each attempt).")
	rm.parked = counter(ParkedMetric, "Outbox rows parked after MaxAttempts refusals.")
	rm.failures = counter(FailuresMetric, "Relay batches that failed because the broker or the database was unavailable.")
	rm.refusals = counter(RefusalsMetric, "Relay batches that failed because the broker refused the publisher (credentials, permissions, TLS or SASL settings).")
	rm.meter = m
	if err == nil {
		rm.leaderGauge, err = m.Int64ObservableGauge(LeaderMetric, metric.WithDescription("1 while this relay leads, else 0."))
	}
	if err == nil {
		rm.stalledGauge, err = m.Int64ObservableGauge(StalledMetric,
			metric.WithDescription("1 while this relay has given up a call to the publisher that has not returned, else 0."))
	}
	if err != nil {
		return nil, fmt.Errorf("outbox: metrics: %w", err)
	}
	return rm, nil
}

// start registers the gauges' callback, which reports leader and
// stalled; Run calls it first, and stop when it returns.
func (rm *relayMetrics) start(leader, stalled func() bool) error {
	var err error
	rm.gauges, err = rm.meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		o.ObserveInt64(rm.leaderGauge, flag(leader()), rm.attrs)
		o.ObserveInt64(rm.stalledGauge, flag(stalled()), rm.attrs)
		return nil
	}, rm.leaderGauge, rm.stalledGauge)
	if err != nil {
		return fmt.Errorf("outbox: metrics: %w", err)
	}
	return nil
}

// flag is a gauge's value of b: 1 or 0.
func flag(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// stop unregisters the gauges' callback: the relay is done.
func (rm *relayMetrics) stop() {
	if rm.gauges != nil {
		_ = rm.gauges.Unregister()
	}
}

const instrumentationName = "github.com/onceco/once/outbox"

func newTracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(instrumentationName)
}

// maxLinks bounds the links of a batch's span.
const maxLinks = 128

// startBatchSpan starts the producer span of a batch, linked (when it
// records) to the spans that wrote the batch's rows.
func (r *Relay) startBatchSpan(ctx context.Context, batch []Record) (context.Context, trace.Span) {
	ctx, span := r.tracer.Start(ctx, "outbox publish", trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attribute.String("once.outbox.table", r.cfg.Store.label),
			attribute.Int("messaging.batch.message_count", len(batch))))
	if !span.IsRecording() {
		return ctx, span
	}
	prop := otel.GetTextMapPropagator()
	for i, rec := range batch {
		if i == maxLinks {
			break
		}
		if sc := writerSpanContext(prop, rec.Headers); sc.IsValid() {
			span.AddLink(trace.Link{SpanContext: sc, Attributes: []attribute.KeyValue{attribute.String("messaging.message.id", rec.EventID)}})
		}
	}
	return ctx, span
}

// writerSpanContext is the span context of the writer of a row with
// headers: read with the global propagator, or, when that finds none (it
// is a no-op until a service sets one, and Add then stored W3C
// traceparent), from a W3C traceparent header.
func writerSpanContext(prop propagation.TextMapPropagator, headers map[string]string) trace.SpanContext {
	carrier := propagation.MapCarrier(headers)
	if sc := trace.SpanContextFromContext(prop.Extract(context.Background(), carrier)); sc.IsValid() {
		return sc
	}
	return trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), carrier))
}

// endBatchSpan ends span with the batch's outcome.
func endBatchSpan(span trace.Span, sent, rejected int, err error) {
	span.SetAttributes(attribute.Int("once.outbox.sent", sent), attribute.Int("once.outbox.rejected", rejected))
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, errorText(err))
	}
	span.End()
}
