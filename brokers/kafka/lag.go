package kafka

import (
	"context"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceco/once/internal/kafkaend"
)

// LagMetricName is the name of the consumer-lag gauge: per topic and
// partition claimed by this member, the offsets between the offset after
// the last record handed to the consumer (or skipped as recorded done,
// with Config.OffsetsInDatabase) and the end of what the member can read,
// i.e. about the number of records written to the partition that this
// member has not received yet. Reading committed records (the default)
// that end is the partition's last stable offset, and the offsets the
// member will never be handed at its position are passed first: the
// marker that ends each transaction (an offset no record uses) and the
// records of aborted transactions; so a member caught up reports 0, and
// the records of a transaction still open are no lag until it commits.
// Past the first record still to be handed out, every offset up to the
// end counts, the markers and aborted records among them: a committed
// transaction of two records not handed out yet counts 3 (its records
// and its marker), and 0 once they are. Counting records alone would
// take reading every batch up to the end at each collection. With
// Config.ReadUncommitted the end is the high-water mark. It carries the
// attributes messaging.system ("kafka"), messaging.consumer.group.name,
// messaging.destination.name (the topic) and
// messaging.destination.partition.id. A partition is reported while it is
// claimed, once its position is known (a committed offset or a first
// record). Reading committed records, a collection asks the partition's
// leader (ListOffsets, and a Fetch of a batch or a few) for each claimed
// partition that sarama's last fetch does not show caught up, waiting at
// most a second for the answer.
const LagMetricName = "once.kafka.consumer.lag"

// GroupRefusedMetricName is the name of the counter of joins of the
// consumer group that the group coordinator refused because of the
// group's other members: the brokers' group.max.size reached
// (error.type group_max_size_reached), or another member of the group id
// using another protocol type or no rebalance strategy in common with
// this one (inconsistent_group_protocol). The Source retries the join,
// as it succeeds once those members leave, and logs each refusal at
// level Error; meanwhile it consumes nothing, so any increase wants
// looking at. Its attributes are messaging.system ("kafka"),
// messaging.consumer.group.name and error.type.
const GroupRefusedMetricName = "once.kafka.consumer.group.join_refused"

const meterName = "github.com/onceco/once/brokers/kafka"

// lagGauge reports the lag of the claims a Source currently holds, and
// counts the offsets skipped by starts out of range.
type lagGauge struct {
	group string
	reg   metric.Registration

	mu     sync.Mutex
	claims map[*claim]struct{}

	// outOfRange counts the offsets skipped by starts out of range
	// (OutOfRangeMetricName), beside the gauge.
	outOfRange metric.Int64Counter
	// joinsRefused counts the joins refused by the group's other members
	// (GroupRefusedMetricName).
	joinsRefused metric.Int64Counter
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
	g.outOfRange, err = meter.Int64Counter(OutOfRangeMetricName,
		metric.WithUnit("{message}"),
		metric.WithDescription("Offsets of a partition that a claim skipped because the position it was to start at was below the partition's first offset (deleted by retention before they were handled)."))
	if err != nil {
		return nil, fmt.Errorf("kafka: Config.MeterProvider: out-of-range counter: %w", err)
	}
	g.joinsRefused, err = meter.Int64Counter(GroupRefusedMetricName,
		metric.WithUnit("{join}"),
		metric.WithDescription("Joins of the consumer group that the coordinator refused because of the group's other members (group.max.size reached, no rebalance strategy in common); the member consumes nothing meanwhile."))
	if err != nil {
		return nil, fmt.Errorf("kafka: Config.MeterProvider: group refusal counter: %w", err)
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
			o.ObserveInt64(gauge, lag, g.attributes(cl.sc.Topic(), cl.sc.Partition()))
		}
		return nil
	}, gauge)
	if err != nil {
		return nil, fmt.Errorf("kafka: Config.MeterProvider: lag callback: %w", err)
	}
	return g, nil
}

// claimOf returns the claim of topic's partition that the Source holds, or
// nil.
func (g *lagGauge) claimOf(topic string, partition int32) *claim {
	g.mu.Lock()
	defer g.mu.Unlock()
	for cl := range g.claims {
		if cl.sc.Partition() == partition && cl.sc.Topic() == topic {
			return cl
		}
	}
	return nil
}

// attributes are the metrics' attributes of a partition.
func (g *lagGauge) attributes(topic string, partition int32) metric.MeasurementOption {
	return metric.WithAttributes(
		attribute.String("messaging.system", "kafka"),
		attribute.String("messaging.consumer.group.name", g.group),
		attribute.String("messaging.destination.name", topic),
		attribute.String("messaging.destination.partition.id", fmt.Sprint(partition)),
	)
}

// joinRefused counts a join of the group refused for reason
// (groupRefusal).
func (g *lagGauge) joinRefused(reason string) {
	g.joinsRefused.Add(context.Background(), 1, metric.WithAttributes(
		attribute.String("messaging.system", "kafka"),
		attribute.String("messaging.consumer.group.name", g.group),
		attribute.String("error.type", reason),
	))
}

// skippedOutOfRange counts n offsets of the partition skipped by a start
// out of range.
func (g *lagGauge) skippedOutOfRange(topic string, partition int32, n int64) {
	g.outOfRange.Add(context.Background(), n, g.attributes(topic, partition))
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

// lag returns the claim's lag, and false while its position is unknown or
// once its topic was found deleted (topicgone.go).
//
// With Config.ReadUncommitted it is the high-water mark minus the offset
// after the last record: sarama's mark, from the partition's last fetch;
// a paused partition fetches nothing, so its mark is asked of the cluster
// (unless ctx, the collection's, is done).
//
// Reading committed records, the high-water mark counts offsets the
// member is never handed, or not yet: the marker that ends each
// transaction (an offset no record uses), the records of aborted
// transactions, and those of a transaction still open. Unless sarama's
// mark shows the partition caught up, the cluster is asked its last
// stable offset and the first record at or after the member's position
// that the member will be handed (clusterEnd); the lag is the offsets
// from there to the last stable offset.
func (cl *claim) lag(ctx context.Context) (int64, bool) {
	last := cl.last.Load()
	if last == unknownOffset || cl.topicGone.Load() != topicThere {
		return 0, false
	}
	next := last + 1
	hwm := cl.sc.HighWaterMarkOffset()
	paused := cl.paused.Load()
	if cl.src.cfg.ReadUncommitted {
		if paused && ctx.Err() == nil {
			if e := cl.clusterEnd(ctx, next); e != nil {
				hwm = max(hwm, e.end)
			}
		}
		return max(hwm-next, 0), true
	}
	if !paused && hwm <= next {
		return 0, true
	}
	var e *readableEnd
	if ctx.Err() == nil {
		e = cl.clusterEnd(ctx, next)
	} else {
		e = cl.end.Load()
	}
	if e == nil {
		return max(hwm-next, 0), true
	}
	return max(e.end-max(next, e.from), 0), true
}

// readableEnd is the cluster's answer of where a claim's partition ends.
type readableEnd struct {
	// end is the partition's end: its last stable offset reading
	// committed records, else its high-water mark.
	end int64
	// from is the offset of the first record at or after the member's
	// position when asked that the member will be handed (end when
	// none): the offsets before it are transaction markers and records
	// of aborted transactions. With Config.ReadUncommitted, the position.
	from int64
}

// endWait bounds how long a collection waits for the cluster to say where
// a paused partition ends.
const endWait = time.Second

// clusterEnd asks the cluster where the claim's partition ends, and,
// reading committed records, where its first record at or after next that
// the member will be handed is; it waits for the answer at most endWait,
// or until ctx ends: a broker that does not answer would hold the whole
// collection, every metric of the process with it, for sarama's read
// timeout. A question left unanswered goes on aside, one at a time per
// claim; it returns the latest answer (nil when none yet).
func (cl *claim) clusterEnd(ctx context.Context, next int64) *readableEnd {
	if cl.endAsked.CompareAndSwap(false, true) {
		done := make(chan struct{})
		go func() {
			defer close(done)
			defer cl.endAsked.Store(false)
			topic, partition := cl.sc.Topic(), cl.sc.Partition()
			end, err := cl.src.partitionEnd(topic, partition)
			if err != nil {
				return
			}
			from := next
			if !cl.src.cfg.ReadUncommitted && end > next {
				from = kafkaend.FirstReadable(cl.src.dlqClient, topic, partition, next, end)
			}
			cl.end.Store(&readableEnd{end: end, from: from})
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
