package outbox

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
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
	// LeaderMetric is 1 while the relay leads, else 0.
	LeaderMetric = "once.outbox.leader"
)

// relayMetrics are the relay's instruments; every measurement carries the
// table's name.
type relayMetrics struct {
	published, rejected, parked, failures metric.Int64Counter
	attrs                                 metric.MeasurementOption
}

func newRelayMetrics(mp metric.MeterProvider, table string, leader func() bool) (*relayMetrics, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	m := mp.Meter("github.com/onceco/once/outbox")
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
	if err == nil {
		_, err = m.Int64ObservableGauge(LeaderMetric, metric.WithDescription("1 while this relay leads, else 0."),
			metric.WithInt64Callback(func(_ context.Context, o metric.Int64Observer) error {
				v := int64(0)
				if leader() {
					v = 1
				}
				o.Observe(v, rm.attrs)
				return nil
			}))
	}
	if err != nil {
		return nil, fmt.Errorf("outbox: metrics: %w", err)
	}
	return rm, nil
}
