package main

// The second hop. The order processor emits order.confirmed for each
// order it marks paid, through the transactional outbox (outbox.Add's
// statement queued in the handler's transaction, see Orders.Paid); a relay
// in the same process publishes the committed rows; a shipping service,
// a consumer of its own (its own Name, Kafka group or queue, and table),
// ships each confirmed order. Each hop deduplicates by event id, so each
// paid order has one confirmation row, one outbox row and one shipment
// whatever crashes, even though the wire may carry copies.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/amqpout"
	"github.com/onceco/once/outbox/kafkaout"
)

// TypeConfirmed is the type of the event the order processor emits for
// each paid order.
const TypeConfirmed = "order.confirmed"

// OrderConfirmed is the payload of an order.confirmed event.
type OrderConfirmed struct {
	OrderID     string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
}

// ShippingSchema creates the shipping service's table. Like payments, it
// has no unique constraint on order_id on purpose: a shipment made twice
// must show in the counts, not be hidden by the table.
const ShippingSchema = `
CREATE TABLE IF NOT EXISTS shipments (
	order_id   text NOT NULL,
	event_id   text NOT NULL,
	shipped_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS shipments_order_id ON shipments (order_id);
`

// keepSent is how long the relay keeps a published outbox row (marked
// sent) before deleting it. The demo keeps them so that its report can
// count one published row per paid order; a service keeps none (0, the
// default) or an audit window.
const keepSent = time.Hour

// confirmedDest is where order.confirmed goes: a Kafka topic, or a
// RabbitMQ queue through the default exchange.
type confirmedDest struct {
	Topic      string // Kafka topic, or AMQP exchange ("" is the default exchange)
	RoutingKey string // AMQP: the queue's name
}

// confirmedName is the Kafka topic or RabbitMQ queue of order.confirmed.
func confirmedName(o *options) string { return o.topic + ".confirmed" }

// shippingName is the shipping consumer's name (and Kafka group).
func shippingName(o *options) string { return o.name + "-shipping" }

// destination returns where o's broker takes order.confirmed.
func destination(o *options) *confirmedDest {
	if o.broker == "amqp" {
		return &confirmedDest{RoutingKey: confirmedName(o)}
	}
	return &confirmedDest{Topic: confirmedName(o)}
}

// confirmation is the outbox message for a paid order. Its id derives from
// the payment event's id, so that the same payment confirms under one id
// whoever handles it.
func (d *confirmedDest) confirmation(ev consumer.Event[OrderPaid]) (outbox.Message, error) {
	body, err := json.Marshal(OrderConfirmed{OrderID: ev.Payload.OrderID, AmountCents: ev.Payload.AmountCents})
	if err != nil {
		return outbox.Message{}, err
	}
	return outbox.Message{ID: ev.ID + "/confirmed", Topic: d.Topic, RoutingKey: d.RoutingKey,
		Key: []byte(ev.Payload.OrderID), Type: TypeConfirmed, Body: body}, nil
}

// outboxStore is the outbox table on the pool's search path.
var outboxStore = func() *outbox.Store {
	s, err := outbox.New(outbox.Config{})
	if err != nil {
		panic(err) // the zero Config is valid
	}
	return s
}()

// Ship is the shipping service's handler: one shipment per confirmed
// order. The consumer skips an order.confirmed it has seen (a copy the
// relay published again after a crash), so the handler does not check.
func Ship(_ context.Context, tx pgx.Tx, ev consumer.Event[OrderConfirmed]) error {
	if ev.Payload.OrderID == "" {
		return consumer.Permanent(fmt.Errorf("%w: order.confirmed needs order_id", ErrInvalidEvent))
	}
	ev.Queue(`INSERT INTO shipments (order_id, event_id) VALUES ($1, $2)`, ev.Payload.OrderID, ev.ID)
	return nil
}

// downstream is the second hop in one process: the outbox relay and the
// shipping consumer.
type downstream struct {
	relay    *outbox.Relay
	pub      outbox.Publisher
	closePub func() error
	shipping *consumer.Consumer[OrderConfirmed]
}

// newDownstream builds the relay (publishing with kafkaout or amqpout) and
// the shipping consumer. The shipping source opens first: on RabbitMQ it
// declares the queue the relay publishes to (a message with no queue
// bound would be returned unroutable and charged as refused).
func newDownstream(ctx context.Context, o *options, pool *pgxpool.Pool, tel *telemetry, log *slog.Logger) (*downstream, error) {
	src, err := shippingSource(ctx, o, tel, log)
	if err != nil {
		return nil, fmt.Errorf("shipping source: %w", err)
	}
	ship, err := consumer.New(pool, src, Ship, consumer.Config{
		Name:            shippingName(o),
		Retry:           consumer.RetryPolicy{MaxAttempts: o.maxAttempts, InitialBackoff: 50 * time.Millisecond, MaxBackoff: time.Second},
		ShutdownTimeout: 10 * time.Second,
		Telemetry:       consumer.TelemetryConfig{Logger: log, TracerProvider: tel.tracer, MeterProvider: tel.MeterProvider()},
	})
	if err != nil {
		_ = src.Close()
		return nil, err
	}
	d := &downstream{shipping: ship}
	if err := d.openPublisher(o); err != nil {
		_ = src.Close()
		return nil, err
	}
	d.relay, err = outbox.NewRelay(pool, d.pub, outbox.RelayConfig{
		KeepSent:       keepSent,
		PollInterval:   250 * time.Millisecond,
		InfraBackoff:   outbox.Backoff{Initial: 50 * time.Millisecond, Max: time.Second},
		Logger:         log,
		MeterProvider:  tel.MeterProvider(),
		TracerProvider: tel.tracer,
	})
	if err != nil {
		_ = d.closePub()
		_ = src.Close()
		return nil, err
	}
	return d, nil
}

// openPublisher opens the relay's publisher for o's broker.
func (d *downstream) openPublisher(o *options) error {
	if o.broker == "amqp" {
		p, err := amqpout.New(amqpout.Config{URL: o.amqpURL, ConnectionName: "order-processor relay " + o.name,
			ConfirmTimeout: 5 * time.Second})
		if err != nil {
			return err
		}
		d.pub, d.closePub = chaosRelayPublisher(p), p.Close
		return nil
	}
	p, err := kafkaout.New(kafkaout.Config{Brokers: o.kafkaBrokers, Sarama: saramaConfig()})
	if err != nil {
		return err
	}
	d.pub, d.closePub = chaosRelayPublisher(p), p.Close
	return nil
}

// shippingSource opens the shipping consumer's source: the Kafka topic
// "<topic>.confirmed" in a group of its own, or the queue of that name.
func shippingSource(ctx context.Context, o *options, tel *telemetry, log *slog.Logger) (consumer.Source, error) {
	so := *o
	so.topic, so.name = confirmedName(o), shippingName(o)
	if o.broker == "amqp" {
		return amqpSource(ctx, &so, tel, log)
	}
	return kafkaSource(ctx, &so, tel.MeterProvider(), log)
}

// Run runs the relay and the shipping consumer until ctx is cancelled, or
// one of them stops by itself (a failed migration, a fatal source error),
// which stops the other, and both have stopped; it returns their errors.
func (d *downstream) Run(ctx context.Context) error {
	defer func() { _ = d.closePub() }()
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	var wg sync.WaitGroup
	errs := make([]error, 2)
	wg.Add(2)
	go func() { defer wg.Done(); defer stop(); errs[0] = d.relay.Run(ctx) }()
	go func() { defer wg.Done(); defer stop(); errs[1] = d.shipping.Run(ctx) }()
	wg.Wait()
	return errors.Join(errs...)
}

// hopCounts are the second hop's figures, read from the database.
type hopCounts struct {
	PaidOrders     int64 // orders with status paid: each must be confirmed and shipped once
	OutboxRows     int64 // order.confirmed rows written
	OutboxSent     int64 // of them, published (kept sent for the report)
	OutboxPending  int64 // not yet published
	OutboxParked   int64 // refused by the broker
	OutboxMismatch int64 // paid orders without exactly one row whose id is the payment's id + "/confirmed"
	Shipments      int64
	ShippedOnce    int64 // paid orders with exactly one shipment, under their outbox row's id
	ShippedWrongly int64 // shipments of orders that are not paid
	Processed      int64 // the shipping consumer's processed_events rows
	// ProcessedMismatch counts, matched by id, the paid orders'
	// confirmation ids without a processed_events row of the shipping
	// consumer and that consumer's rows under any other id.
	ProcessedMismatch int64
}

// countHop2 reads the second hop's figures.
func countHop2(ctx context.Context, pool *pgxpool.Pool, o *options) (hopCounts, error) {
	var c hopCounts
	err := pool.QueryRow(ctx, `
WITH paid AS (
	SELECT o.id, p.event_id || '/confirmed' AS want_id FROM orders o JOIN payments p ON p.order_id = o.id WHERE o.status = 'paid'
), rows AS (
	SELECT convert_from(key, 'UTF8') AS order_id, count(*) AS n, min(event_id) AS id FROM outbox WHERE type = $2 GROUP BY 1
), ships AS (
	SELECT order_id, count(*) AS n, min(event_id) AS id FROM shipments GROUP BY 1
), per_order AS (
	SELECT paid.id, r.n AS rows, r.id = paid.want_id AS row_id_ok, s.n AS ships, s.id = paid.want_id AS ship_id_ok
	FROM paid LEFT JOIN rows r ON r.order_id = paid.id LEFT JOIN ships s ON s.order_id = paid.id
)
SELECT
	(SELECT count(*) FROM orders WHERE status = 'paid'),
	(SELECT count(*) FROM outbox WHERE type = $2),
	(SELECT count(*) FROM outbox WHERE type = $2 AND sent_at IS NOT NULL),
	(SELECT count(*) FROM outbox WHERE type = $2 AND sent_at IS NULL AND parked_at IS NULL),
	(SELECT count(*) FROM outbox WHERE type = $2 AND parked_at IS NOT NULL),
	(SELECT count(*) FROM per_order WHERE rows IS DISTINCT FROM 1 OR row_id_ok IS NOT TRUE),
	(SELECT count(*) FROM shipments),
	(SELECT count(*) FROM per_order WHERE ships = 1 AND ship_id_ok),
	(SELECT count(*) FROM shipments s WHERE NOT EXISTS (SELECT 1 FROM orders o WHERE o.id = s.order_id AND o.status = 'paid')),
	(SELECT count(*) FROM processed_events WHERE consumer = $1),
	(SELECT count(*) FROM (SELECT event_id FROM processed_events WHERE consumer = $1) pe
		FULL JOIN paid ON paid.want_id = pe.event_id WHERE pe.event_id IS NULL OR paid.want_id IS NULL)`, shippingName(o), TypeConfirmed).
		Scan(&c.PaidOrders, &c.OutboxRows, &c.OutboxSent, &c.OutboxPending, &c.OutboxParked, &c.OutboxMismatch,
			&c.Shipments, &c.ShippedOnce, &c.ShippedWrongly, &c.Processed, &c.ProcessedMismatch)
	return c, err
}

// ok reports whether every paid order was confirmed once, published once
// and shipped once, and nothing else was shipped.
func (c hopCounts) ok() bool {
	return c.PaidOrders > 0 && c.OutboxRows == c.PaidOrders && c.OutboxSent == c.PaidOrders && c.OutboxMismatch == 0 &&
		c.Shipments == c.PaidOrders && c.ShippedOnce == c.PaidOrders && c.ShippedWrongly == 0 && c.Processed == c.PaidOrders &&
		c.ProcessedMismatch == 0
}

// print writes the second hop's lines of the report.
func (c hopCounts) print(w io.Writer, shipping *consumer.Stats, wire *wireCount) {
	fmt.Fprintf(w, "hop 2: outbox     %6d  order.confirmed rows written in the payments' transactions (want %d, one per paid order), %d published, %d pending, %d parked\n",
		c.OutboxRows, c.PaidOrders, c.OutboxSent, c.OutboxPending, c.OutboxParked)
	if wire != nil {
		fmt.Fprintf(w, "       wire       %6d  order.confirmed records, %d distinct ids (copies after a relay crash carry their row's id)\n",
			wire.Records, wire.IDs)
	}
	if shipping != nil {
		fmt.Fprintf(w, "       shipping   %6d  received: %d handled, %d duplicates skipped (the killed run's counts are not included)\n",
			shipping.Received, shipping.Handled, shipping.Duplicates)
	}
	fmt.Fprintf(w, "       shipments  %6d  (want %d: each paid order shipped once, under its confirmation's id; %d shipped once)\n",
		c.Shipments, c.PaidOrders, c.ShippedOnce)
}

// wireCount is what a Kafka topic holds: records and distinct "id" headers.
type wireCount struct{ Records, IDs int }

// countWire reads the order.confirmed topic (Kafka only; a RabbitMQ queue
// is consumed and cannot be read back).
func countWire(o *options) (*wireCount, error) {
	if o.broker != "kafka" {
		return nil, nil
	}
	recs, err := readKafkaTopic(o.kafkaBrokers, confirmedName(o))
	if err != nil {
		return nil, err
	}
	ids := map[string]bool{}
	for _, r := range recs {
		ids[r.Headers["id"]] = true
	}
	return &wireCount{Records: len(recs), IDs: len(ids)}, nil
}

// hop2Drained reports whether the second hop has finished: no outbox row
// waiting, nothing left at the broker for the shipping consumer, and the
// shipping consumer settled with everything it received.
func hop2Drained(ctx context.Context, pool *pgxpool.Pool, lag func(context.Context) (int64, error), s consumer.Stats) (bool, error) {
	var pending int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE sent_at IS NULL AND parked_at IS NULL`).Scan(&pending); err != nil {
		return false, err
	}
	if pending > 0 || !settled(s) {
		return false, nil
	}
	n, err := lag(ctx)
	return err == nil && n == 0, err
}

// shippingLag returns the broker's view of the shipping consumer's
// backlog and a function that releases what it holds.
func shippingLag(o *options) (func(context.Context) (int64, error), func(), error) {
	if o.broker == "amqp" {
		q, err := newAMQPQueues(o.amqpURL, confirmedName(o))
		if err != nil {
			return nil, nil, err
		}
		lag := func(context.Context) (int64, error) { n, _, err := q.Ready(); return int64(n), err }
		return lag, func() { _ = q.Close() }, nil
	}
	kd, err := newKafkaDrained(o.kafkaBrokers, shippingName(o), confirmedName(o))
	if err != nil {
		return nil, nil, err
	}
	return kd.Lag, func() { _ = kd.Close() }, nil
}

// deleteShippingQueues removes the shipping queue and its dead-letter
// queue (RabbitMQ demo runs use queues of their own).
func deleteShippingQueues(o *options) error {
	q, err := newAMQPQueues(o.amqpURL, confirmedName(o))
	if err != nil {
		return err
	}
	defer q.Close()
	return q.Delete()
}

// shippingQueues are the queues prepareAMQP declares for the second hop.
func shippingQueues(o *options) []string {
	return []string{confirmedName(o), confirmedName(o) + amqp.DeadLetterQueueSuffix}
}
