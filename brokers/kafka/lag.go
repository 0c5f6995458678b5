package kafka

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// LagMetricName is the name of the consumer-lag gauge: per topic and
// partition claimed by this member, the partition's high-water mark minus
// the offset after the last record handed to the consumer (or skipped as
// recorded done, with Config.OffsetsInDatabase), i.e. the number of records
// written to the partition that this member has not received yet. It
// carries the attributes messaging.system ("kafka"),
// messaging.consumer.group.name, messaging.destination.name (the topic) and
// messaging.destination.partition.id. A partition is reported while it is
// claimed, once its position is known (a committed offset or a first
// record).
const LagMetricName = "once.kafka.consumer.lag"

const meterName = "github.com/onceco/once/brokers/kafka"

// lagGauge reports the lag of the claims a Source currently holds.
type lagGauge struct {
	group string
	reg   metric.Registration

	mu     sync.Mutex
	claims map[*claim]struct{}
}

func newLagGauge(mp metric.MeterProvider, group string) (*lagGauge, error) {
	g := &lagGauge{group: group, claims: make(map[*claim]struct{})}
	meter := mp.Meter(meterName)
	gauge, err := meter.Int64ObservableGauge(LagMetricName,
		metric.WithUnit("{message}"),
		metric.WithDescription("Records in a claimed partition after the last one received by this consumer-group member."))
	if err != nil {
		return nil, fmt.Errorf("kafka: Config.MeterProvider: lag gauge: %w", err)
	}
	g.reg, err = meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		// Copied, so that a paused claim's question to the cluster holds
		// no claim's start or end.
		g.mu.Lock()
		claims := make([]*claim, 0, len(g.claims))
		for cl := range g.claims {
			claims = append(claims, cl)
		}
		g.mu.Unlock()
		for _, cl := range claims {
			lag, ok := cl.lag(ctx)
			if !ok {
				continue
			}
			o.ObserveInt64(gauge, lag, metric.WithAttributes(
				attribute.String("messaging.system", "kafka"),
				attribute.String("messaging.consumer.group.name", g.group),
				attribute.String("messaging.destination.name", cl.sc.Topic()),
				attribute.String("messaging.destination.partition.id", fmt.Sprint(cl.sc.Partition())),
			))
		}
		return nil
	}, gauge)
	if err != nil {
		return nil, fmt.Errorf("kafka: Config.MeterProvider: lag callback: %w", err)
	}
	return g, nil
}

func (g *lagGauge) track(cl *claim) {
	g.mu.Lock()
	g.claims[cl] = struct{}{}
	g.mu.Unlock()
}

func (g *lagGauge) untrack(cl *claim) {
	g.mu.Lock()
	delete(g.claims, cl)
	g.mu.Unlock()
}

func (g *lagGauge) close() {
	if g.reg != nil {
		_ = g.reg.Unregister()
	}
}

// lag returns the claim's lag, and false while its position is unknown.
// The high-water mark is sarama's, from the partition's last fetch; a
// paused partition fetches nothing, so its mark is asked of the cluster
// (unless ctx, the collection's, is done).
func (cl *claim) lag(ctx context.Context) (int64, bool) {
	last := cl.last.Load()
	if last == unknownOffset {
		return 0, false
	}
	hwm := cl.sc.HighWaterMarkOffset()
	if cl.paused.Load() && ctx.Err() == nil {
		hwm = max(hwm, cl.clusterEnd(ctx))
	}
	return max(hwm-(last+1), 0), true
}

// endWait bounds how long a collection waits for the cluster to say where
// a paused partition ends.
const endWait = time.Second

// clusterEnd asks the cluster where the claim's partition ends and waits
// for the answer at most endWait, or until ctx ends: a broker that does not
// answer would hold the whole collection, every metric of the process
// with it, for sarama's read timeout. A question left unanswered goes on
// aside, one at a time per claim; it returns the latest answer (0 when
// none yet).
func (cl *claim) clusterEnd(ctx context.Context) int64 {
	if cl.endAsked.CompareAndSwap(false, true) {
		done := make(chan struct{})
		go func() {
			defer close(done)
			defer cl.endAsked.Store(false)
			if end, err := cl.src.dlqClient.GetOffset(cl.sc.Topic(), cl.sc.Partition(), sarama.OffsetNewest); err == nil {
				cl.end.Store(end)
			}
		}()
		t := time.NewTimer(endWait)
		defer t.Stop()
		select {
		case <-done:
		case <-t.C:
		case <-ctx.Done():
		}
	}
	return cl.end.Load()
}
