package main

// The chaos run across hops: every member runs the order consumer, an
// outbox relay and the shipping consumer (serve's default), so each kill,
// crash point, PostgreSQL restart and broker cut hits all three. On top of
// those, the driver kills the member whose relay leads (found through the
// leader lock's session in pg_stat_activity) and crashes a relay between
// the broker's confirm and the marking of its rows. At the end it counts,
// for each paid order: one outbox row, published, under the payment's id +
// "/confirmed"; copies on the wire sharing that id (Kafka); one shipment
// under that id.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
)

// relayCrashPoint is the relay's crash point (relaycrash_chaos.go): the
// process exits after the broker confirmed a batch, before the relay
// marked its rows sent.
const relayCrashPoint = "relay-after-publish"

// relayCrashEnv sets the relay's crash point of a member:
// ONCE_RELAY_CRASH=after-publish:n crashes after the n-th confirmed batch.
const relayCrashEnv = "ONCE_RELAY_CRASH"

// memberAppName is the application_name of a member's database sessions
// (PGAPPNAME), which says which member's relay holds the leader lock, and
// its Kafka client id (KAFKA_CLIENT_ID), which says which member process a
// group member is.
func memberAppName(id int) string { return memberAppPrefix + strconv.Itoa(id) }

const memberAppPrefix = "once-chaos-member-"

// Hop2Result is what a chaos run counted on the second hop.
type Hop2Result struct {
	PaidOrders      int64 `json:"paid_orders"`
	OutboxRows      int64 `json:"outbox_rows"`
	OutboxPublished int64 `json:"outbox_published"`
	OutboxPending   int64 `json:"outbox_pending"`
	OutboxParked    int64 `json:"outbox_parked"`
	// OutboxMismatch counts paid orders without exactly one row under the
	// payment's id + "/confirmed".
	OutboxMismatch int64 `json:"outbox_mismatch"`
	// WireRecords and WireIDs are the records of the order.confirmed topic
	// and their distinct ids (Kafka; a RabbitMQ queue is consumed).
	WireRecords int   `json:"wire_records,omitempty"`
	WireIDs     int   `json:"wire_ids,omitempty"`
	Shipments   int64 `json:"shipments"`
	ShippedOnce int64 `json:"shipped_once"`
	// ShippedWrongly counts shipments of orders that are not paid.
	ShippedWrongly int64 `json:"shipped_wrongly"`
	Processed      int64 `json:"processed_events"`
	// ProcessedMismatch counts, matched by id, paid orders' confirmations
	// without a processed_events row of the shipping consumer and its
	// rows under any other id.
	ProcessedMismatch int64 `json:"processed_mismatch"`
	// Replayed counts shipping dead letters of kind crash-loop (in flight
	// at 3 process deaths) put back, as the first hop's are.
	Replayed  int            `json:"replayed"`
	DLQByKind map[string]int `json:"dlq_by_kind,omitempty"`
}

// problems lists what breaks the second hop's promise.
func (h *Hop2Result) problems(wantPaid int) []string {
	var ps []string
	if h.PaidOrders != int64(wantPaid) {
		ps = append(ps, fmt.Sprintf("hop 2: %d paid orders, want %d", h.PaidOrders, wantPaid))
	}
	if h.OutboxRows != h.PaidOrders || h.OutboxMismatch > 0 {
		ps = append(ps, fmt.Sprintf("hop 2: %d outbox rows for %d paid orders (%d orders without exactly one row under their payment's id)",
			h.OutboxRows, h.PaidOrders, h.OutboxMismatch))
	}
	if h.OutboxPublished != h.OutboxRows {
		ps = append(ps, fmt.Sprintf("hop 2: %d outbox rows published of %d (%d pending, %d parked)",
			h.OutboxPublished, h.OutboxRows, h.OutboxPending, h.OutboxParked))
	}
	if h.WireIDs > 0 && int64(h.WireIDs) != h.PaidOrders {
		ps = append(ps, fmt.Sprintf("hop 2: %d distinct ids on the wire for %d paid orders", h.WireIDs, h.PaidOrders))
	}
	if h.ShippedOnce != h.PaidOrders || h.Shipments != h.PaidOrders || h.ShippedWrongly > 0 {
		ps = append(ps, fmt.Sprintf("hop 2: %d shipments, %d paid orders shipped once under their id, of %d (%d shipments of unpaid orders)",
			h.Shipments, h.ShippedOnce, h.PaidOrders, h.ShippedWrongly))
	}
	if h.Processed != h.PaidOrders || h.ProcessedMismatch > 0 {
		ps = append(ps, fmt.Sprintf("hop 2: %d processed_events rows of the shipping consumer, want %d, one under each confirmation's id (%d confirmations without their row or rows of none)",
			h.Processed, h.PaidOrders, h.ProcessedMismatch))
	}
	return ps
}

// print writes the second hop's rows of the chaos table.
func (h *Hop2Result) print(w io.Writer) {
	fmt.Fprintf(w, "%-28s %d\n", "hop 2: paid orders", h.PaidOrders)
	fmt.Fprintf(w, "%-28s %d rows, %d marked published (%d pending, %d parked, %d orders without exactly one row under their id)\n",
		"  outbox (order.confirmed)", h.OutboxRows, h.OutboxPublished, h.OutboxPending, h.OutboxParked, h.OutboxMismatch)
	if h.WireRecords > 0 {
		fmt.Fprintf(w, "%-28s %d records, %d distinct ids (%d copies re-published after a relay died)\n",
			"  on the wire", h.WireRecords, h.WireIDs, h.WireRecords-h.WireIDs)
	}
	fmt.Fprintf(w, "%-28s %d shipments, %d orders shipped exactly once, %d shipments of unpaid orders\n",
		"  shipping effect once", h.Shipments, h.ShippedOnce, h.ShippedWrongly)
	fmt.Fprintf(w, "%-28s %d (%d not matching a confirmation's id)\n", "  shipping processed_events", h.Processed, h.ProcessedMismatch)
	if h.Replayed > 0 || len(h.DLQByKind) > 0 {
		fmt.Fprintf(w, "%-28s %s, %d replayed (crash-loop)\n", "  shipping DLQ records", kindList(h.DLQByKind), h.Replayed)
	}
}

// withHop2Backlog makes r.lag count the second hop's backlog too: outbox
// rows not yet published and the shipping consumer's lag at the broker.
// The drain then waits for the relays and the shipping consumer as well.
func (r *chaosRun) withHop2Backlog() error {
	upstream := r.lag
	shipLag, closeLag, err := shippingLag(r.o)
	if err != nil {
		return err
	}
	r.closers = append(r.closers, closeLag)
	var lastSaid time.Time
	r.lag = func(ctx context.Context) (int64, error) {
		n, err := upstream(ctx)
		if err != nil {
			return 0, err
		}
		m, err := shipLag(ctx)
		if err != nil {
			return 0, err
		}
		var pending, parked int64
		qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		err = r.pool.QueryRow(qctx, `SELECT count(*) FILTER (WHERE parked_at IS NULL), count(*) FILTER (WHERE parked_at IS NOT NULL)
FROM outbox WHERE sent_at IS NULL`).Scan(&pending, &parked)
		if err == nil && m+pending+parked > 0 && time.Since(lastSaid) > 10*time.Second {
			// Say what the second hop waits for, for a drain that does not end.
			r.logf("hop 2 backlog: %d outbox rows pending, %d parked, shipping lag %d", pending, parked, m)
			lastSaid = time.Now()
		}
		return n + m + pending, err
	}
	return nil
}

// hop2Faults are the faults of the second hop: kills of the member whose
// relay leads, and the relay's crash point.
func (r *chaosRun) hop2Faults() []fault {
	var fs []fault
	for i := 0; i < r.cfg.RelayKills; i++ {
		fs = append(fs, fault{kind: "relay-leader-kill"})
	}
	return fs
}

// killRelayLeader kills (SIGKILL) the member whose relay holds the leader
// lock, mid-stream. It waits up to 10s for a relay to lead, and fails if
// none does: the relays' failover is broken.
func (r *chaosRun) killRelayLeader(ctx context.Context) error {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var app string
		qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := r.pool.QueryRow(qctx, `SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.classid = $1::bigint::oid AND l.objid = 'outbox'::regclass::oid AND l.objsubid = 2 AND l.granted`,
			int64(0x6f626f78)).Scan(&app)
		cancel()
		if err == nil {
			for _, m := range r.live() {
				if memberAppName(m.id) == app {
					r.logf("SIGKILL of member %d, whose relay leads", m.id)
					killed := m.kill()
					r.forget(m)
					if killed {
						return nil
					}
					r.logf("member %d had exited already; waiting for the next leader", m.id)
				}
			}
		}
		pause(ctx, 100*time.Millisecond)
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	// Three members run a relay each: one of them leads within its poll
	// interval (250 ms) of the last leader's end, reconnection included.
	return errors.New("no member's relay held the leader lock within 10s")
}

// crashEnv is the environment that arms crash point f in a member.
func crashEnv(f fault) string {
	if f.point == relayCrashPoint {
		return fmt.Sprintf("%s=after-publish:%d", relayCrashEnv, f.n)
	}
	return fmt.Sprintf("ONCE_CRASH_POINT=%s:%d", f.point, f.n)
}

// stopOthersForRelayCrash kills every member before the relay's crash
// point is armed in a new one: it must be the one whose relay leads.
func (r *chaosRun) stopOthersForRelayCrash(f fault) {
	if f.point != relayCrashPoint {
		return
	}
	for _, m := range r.live() {
		m.kill()
		r.forget(m)
	}
}

// shippingDeadLetters reads the shipping consumer's dead-letter queue.
func (r *chaosRun) shippingDeadLetters() ([]deadLetter, error) {
	if r.isKafka() {
		return readKafkaTopic(r.o.kafkaBrokers, confirmedName(r.o)+kafka.DefaultDeadLetterSuffix)
	}
	q, err := newAMQPQueues(r.o.amqpURL, confirmedName(r.o))
	if err != nil {
		return nil, err
	}
	defer q.Close()
	return q.DeadLetters()
}

// replayHop2 puts back the shipping dead letters of kind crash-loop (in
// flight at CrashGuard.MaxCrashes process deaths) whose order has no shipment,
// once per event id, with their original key, value, id and type, and
// lets the members drain them. It returns the shipping dead-letter records
// by kind and how many it replayed.
func (r *chaosRun) replayHop2(ctx context.Context, exe string) (map[string]int, int, error) {
	dlq, err := r.shippingDeadLetters()
	if err != nil {
		return nil, 0, fmt.Errorf("read the shipping dead-letter queue: %w", err)
	}
	byKind := map[string]int{}
	var replay []outMsg
	seen := map[string]bool{}
	for _, d := range dlq {
		kind := d.Headers[consumer.HeaderErrorKind]
		byKind[kind]++
		id := d.Headers[consumer.HeaderEventID]
		if kind != string(consumer.KindCrashLoop) || seen[id] {
			continue
		}
		seen[id] = true
		var shipped bool
		if err := r.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM shipments WHERE event_id = $1)`, id).Scan(&shipped); err != nil {
			return nil, 0, err
		}
		if shipped {
			continue
		}
		m := outMsg{Key: string(d.Key), Value: d.Value, ID: d.ID, Type: d.Type}
		if m.ID == "" {
			m.ID = d.Headers["id"]
		}
		if m.Type == "" {
			m.Type = d.Headers["type"]
		}
		replay = append(replay, m)
	}
	if len(replay) == 0 {
		return byKind, 0, nil
	}
	r.logf("replaying %d shipping dead letters (crash-loop)", len(replay))
	so := *r.o
	so.topic = confirmedName(r.o)
	pub, err := newPublisher(ctx, &so)
	if err != nil {
		return nil, 0, err
	}
	err = pub.Publish(ctx, replay)
	_ = pub.Close()
	if err != nil {
		return nil, 0, err
	}
	return byKind, len(replay), r.drain(ctx, exe)
}

// countHop2 counts the second hop's effects.
func (r *chaosRun) countHop2(ctx context.Context) (*Hop2Result, error) {
	c, err := countHop2(ctx, r.pool, r.o)
	if err != nil {
		return nil, err
	}
	h := &Hop2Result{PaidOrders: c.PaidOrders, OutboxRows: c.OutboxRows, OutboxPublished: c.OutboxSent,
		OutboxPending: c.OutboxPending, OutboxParked: c.OutboxParked, OutboxMismatch: c.OutboxMismatch,
		Shipments: c.Shipments, ShippedOnce: c.ShippedOnce, ShippedWrongly: c.ShippedWrongly, Processed: c.Processed,
		ProcessedMismatch: c.ProcessedMismatch}
	if r.isKafka() {
		wire, err := countWire(r.o)
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", confirmedName(r.o), err)
		}
		h.WireRecords, h.WireIDs = wire.Records, wire.IDs
	}
	return h, nil
}

// hop2Names are the consumer names whose processed events show progress.
func hop2Names(o *options) []string { return []string{o.name, shippingName(o)} }
