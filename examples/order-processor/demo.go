package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/idempotency"
)

// childEnv marks a consumer process started by the demo (the test binary
// checks it in TestMain to run the command instead of the tests).
const childEnv = "ORDER_PROCESSOR_CHILD"

// demo publishes generated traffic, consumes it in two runs (the first one
// killed mid-stream), and checks the database against what was sent.
func demo(ctx context.Context, o *options, stdout, stderr io.Writer) error {
	if (o.broker == "kafka" && len(o.kafkaBrokers) > 0) || o.broker == "amqp" {
		// A real broker may hold an earlier run's messages and offsets:
		// use a topic (queue) and group of this run's own.
		o.topic = fmt.Sprintf("%s-demo-%d", o.topic, o.mix.Seed)
		o.name = fmt.Sprintf("%s-demo-%d", o.name, o.mix.Seed)
	}
	inf, err := startInfra(ctx, o, stdout)
	if err != nil {
		return err
	}
	defer inf.Close()
	var queues *amqpQueues
	if o.broker == "amqp" {
		if err := prepareAMQP(ctx, o); err != nil {
			return err
		}
		if queues, err = newAMQPQueues(o.amqpURL, o.topic); err != nil {
			return err
		}
		// The run's queues go however it ends: prepareAMQP declared the
		// second hop's too, with or without -shipping.
		defer func() {
			_ = queues.Delete()
			_ = queues.Close()
			_ = deleteShippingQueues(o)
		}()
	}
	tel, err := startTelemetry(o.metricsAddr, o.traces)
	if err != nil {
		return err
	}
	defer tel.Close()
	if tel.addr != "" {
		fmt.Fprintf(stdout, "metrics: http://%s/metrics  health: http://%s/healthz\n", tel.addr, tel.addr)
	}

	pool, err := openPool(ctx, inf.dbURL, o.schema)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := resetDemoTables(ctx, pool); err != nil {
		return err
	}

	plan := Generate(o.mix)
	pub, err := newPublisher(ctx, o)
	if err != nil {
		return err
	}
	start := time.Now()
	err = pub.Publish(ctx, plan.Messages)
	_ = pub.Close()
	if err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	fmt.Fprintf(stdout, "published %d messages for %d orders in %s (seed %d)\n", len(plan.Messages), o.mix.Orders,
		time.Since(start).Round(time.Millisecond), o.mix.Seed)

	web, err := placeWebOrders(ctx, o, pool, plan, logger(o, stderr)) // http.go: the same orders over HTTP
	if err != nil {
		return fmt.Errorf("http orders: %w", err)
	}

	var run1 int64
	if o.crash {
		t1 := time.Now()
		if run1, err = killedRun(ctx, o, inf.dbURL, pool, plan.uniqueEvents()/2, stderr); err != nil {
			return err
		}
		if queues != nil {
			if err := queues.WaitNoConsumers(ctx); err != nil {
				return err
			}
		}
		fmt.Fprintf(stdout, "run 1: killed the consumer process (SIGKILL) after %s, %d events committed; what it had not acked goes to run 2\n",
			time.Since(t1).Round(time.Millisecond), run1)
		if o.shipping {
			fmt.Fprintln(stdout, "       (its outbox relay and shipping consumer died with it: rows it had published but not marked go out again)")
		}
	}

	// The broker's view of the backlog: what the drained condition waits on.
	var lag func(context.Context) (int64, error)
	if o.broker == "kafka" {
		kd, err := newKafkaDrained(o.kafkaBrokers, o.name, o.topic)
		if err != nil {
			return err
		}
		defer kd.Close()
		lag = kd.Lag
	} else {
		lag = func(context.Context) (int64, error) { n, _, err := queues.Ready(); return int64(n), err }
	}
	readDLQ := func() ([]deadLetter, error) {
		if o.broker == "kafka" {
			return readKafkaTopic(o.kafkaBrokers, o.topic+".dlq")
		}
		return queues.DeadLetters()
	}
	noun := map[string]string{"kafka": "topic", "amqp": "queue"}[o.broker]

	t2 := time.Now()
	run2, ship2, err := runDrained(ctx, o, pool, tel, lag, "run 2:", stderr)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "run 2: drained the %s in %s\n", noun, time.Since(t2).Round(time.Millisecond))

	// Dead letters are for replay once their cause is fixed. Events that
	// overtook their order.created by more than the retry window (possible
	// without order, after a crash: RabbitMQ puts the killed consumer's
	// unacked messages back out of place) were dead-lettered with
	// ErrUnknownOrder; their order exists now, so replay them.
	dlq, err := readDLQ()
	if err != nil {
		return fmt.Errorf("read the dead-letter queue: %w", err)
	}
	replay, err := replayable(ctx, pool, dlq)
	if err != nil {
		return err
	}
	var run3 *consumer.Stats
	if len(replay) > 0 {
		pub, err := newPublisher(ctx, o)
		if err != nil {
			return err
		}
		err = pub.Publish(ctx, replay)
		_ = pub.Close()
		if err != nil {
			return fmt.Errorf("replay: %w", err)
		}
		t3 := time.Now()
		s, ship3, err := runDrained(ctx, o, pool, tel, lag, "run 3:", stderr)
		if err != nil {
			return err
		}
		run3 = &s
		ship2 = addStats(ship2, ship3)
		fmt.Fprintf(stdout, "run 3: replayed %d dead letters whose order exists now, drained in %s\n", len(replay),
			time.Since(t3).Round(time.Millisecond))
		if dlq, err = readDLQ(); err != nil {
			return fmt.Errorf("read the dead-letter queue: %w", err)
		}
	}
	elapsed := time.Since(start)
	return report(ctx, stdout, pool, o, plan, runs{killed: run1, second: run2, third: run3, web: web, shipping: ship2}, dlq, elapsed)
}

// runDrained runs a consumer until the broker has nothing left for it and
// it has settled everything it received, then, with o.shipping, until the
// second hop has finished too (every outbox row published, the shipping
// consumer drained), and stops them (draining). It returns both
// consumers' counts.
func runDrained(ctx context.Context, o *options, pool *pgxpool.Pool, tel *telemetry,
	lag func(context.Context) (int64, error), label string, stderr io.Writer) (orders, shipping consumer.Stats, err error) {
	log := logger(o, stderr)
	src, err := newSource(ctx, o, tel, log)
	if err != nil {
		return orders, shipping, err
	}
	c, err := newConsumer(pool, src, o, tel, log)
	if err != nil {
		_ = src.Close()
		return orders, shipping, err
	}
	var down *downstream
	if o.shipping {
		if down, err = newDownstream(ctx, o, pool, tel, log); err != nil {
			_ = src.Close()
			return orders, shipping, err
		}
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 1)
	downc := make(chan error, 1)
	tel.pool.Store(pool)
	tel.running.Store(true)
	defer tel.running.Store(false)
	p := startProgress(stderr, label, c.Stats)
	go func() { errc <- c.Run(runCtx) }()
	if down != nil {
		go func() { downc <- down.Run(runCtx) }()
	}
	err = waitDrained(ctx, c, lag, errc)
	if err == nil && down != nil {
		err = waitHop2Drained(ctx, o, pool, down, downc)
	}
	cancel()
	if err == nil {
		err = <-errc
	}
	if down != nil {
		if derr := <-downc; err == nil {
			err = derr
		}
		shipping = down.shipping.Stats()
	}
	p.Stop()
	return c.Stats(), shipping, err
}

// waitHop2Drained waits until the second hop has finished (hop2Drained)
// twice in a row 100 ms apart, with the shipping consumer's counts
// unchanged between the two.
func waitHop2Drained(ctx context.Context, o *options, pool *pgxpool.Pool, down *downstream, downc <-chan error) error {
	lag, closeLag, err := shippingLag(o)
	if err != nil {
		return err
	}
	defer closeLag()
	deadline := time.After(3 * time.Minute)
	var prev consumer.Stats
	streak := 0
	for {
		s := down.shipping.Stats()
		done, err := hop2Drained(ctx, pool, lag, s)
		if err != nil {
			return err
		}
		if done && s == prev {
			streak++
		} else {
			streak = 0
		}
		if streak >= 2 {
			return nil
		}
		prev = s
		select {
		case err := <-downc:
			if err == nil {
				err = errors.New("the relay or the shipping consumer stopped before the second hop was drained")
			}
			return err
		case <-deadline:
			return fmt.Errorf("the second hop did not drain within 3 minutes (shipping %+v)", s)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// addStats adds the counters of b to a.
func addStats(a, b consumer.Stats) consumer.Stats {
	a.Received += b.Received
	a.Handled += b.Handled
	a.Duplicates += b.Duplicates
	a.Skipped += b.Skipped
	a.DeadLettered += b.DeadLettered
	a.Retries += b.Retries
	a.InfraErrors += b.InfraErrors
	return a
}

// deadLetter is one record of the dead-letter queue.
type deadLetter struct {
	Key, Value []byte
	Headers    map[string]string
	// ID and Type are the AMQP message-id and type properties (empty on
	// Kafka, where they are headers).
	ID, Type string
}

// replayable returns the dead letters to publish again: those that failed
// because their order did not exist yet and whose order exists now, once
// per event id, with their original key, value, id and type.
func replayable(ctx context.Context, pool *pgxpool.Pool, dlq []deadLetter) ([]outMsg, error) {
	var out []outMsg
	seen := map[string]bool{}
	for _, d := range dlq {
		id := d.Headers[consumer.HeaderEventID]
		if seen[id] || !waitedForOrder(d) {
			continue
		}
		seen[id] = true
		var key struct {
			OrderID string `json:"order_id"`
		}
		if json.Unmarshal(d.Value, &key) != nil {
			continue
		}
		var exists bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM orders WHERE id = $1)`, key.OrderID).Scan(&exists); err != nil {
			return nil, err
		}
		if !exists {
			continue // a payment for an order that never came: it stays dead-lettered
		}
		m := outMsg{Key: string(d.Key), Value: d.Value, ID: d.ID, Type: d.Type}
		if m.ID == "" {
			m.ID = d.Headers["id"]
		}
		if m.Type == "" {
			m.Type = d.Headers["type"]
		}
		out = append(out, m)
	}
	return out, nil
}

// runs is what the consumer runs of the demo did.
type runs struct {
	killed int64 // events committed by the killed run
	second consumer.Stats
	third  *consumer.Stats // the replay run, if any
	web    *webRun         // the orders placed over HTTP, if any
	// shipping is the shipping consumer's counts over runs 2 and 3.
	shipping consumer.Stats
}

// resetDemoTables leaves the demo's tables empty: it drops the service's
// own (they are recreated in their current shape) and empties the
// library's, whose versions once_schema_versions records: a table dropped
// under its recorded version would not be created again.
func resetDemoTables(ctx context.Context, pool *pgxpool.Pool) error {
	if _, err := pool.Exec(ctx, `DROP TABLE IF EXISTS shipments, payments, orders`); err != nil {
		return err
	}
	if err := Migrate(ctx, pool); err != nil {
		return err
	}
	store, err := dedup.New(dedup.Config{})
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx, pool); err != nil {
		return err
	}
	if err := idempotency.Migrate(ctx, pool, ""); err != nil {
		return err
	}
	_, err = pool.Exec(ctx, `TRUNCATE outbox, processed_events, processed_events_attempts, processed_events_offsets, idempotency_keys`)
	return err
}

// killedRun starts a consumer process (this program's serve command), lets
// it commit at least target events, and kills it with SIGKILL: no drain, no
// offset commit, no ack of what it had in flight. It returns how many events
// had committed.
func killedRun(ctx context.Context, o *options, dbURL string, pool *pgxpool.Pool, target int, stderr io.Writer) (int64, error) {
	exe, err := os.Executable()
	if err != nil {
		return 0, err
	}
	args := []string{"serve", "-broker", o.broker, "-topic", o.topic, "-name", o.name, "-schema", o.schema,
		"-metrics-addr", "off", "-label", "run 1:", "-shipping=" + strconv.FormatBool(o.shipping),
		"-unknown-order-wait", o.unknownOrderWait.String(), "-max-attempts", strconv.Itoa(o.maxAttempts)}
	if o.fastFailover {
		args = append(args, "-fast-failover")
	}
	if o.offsetsInDB {
		args = append(args, "-offsets-in-database")
	}
	if o.verbose {
		args = append(args, "-v")
	}
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), childEnv+"=1", "DATABASE_URL="+dbURL,
		"KAFKA_BROKERS="+strings.Join(o.kafkaBrokers, ","), "AMQP_URL="+o.amqpURL, "BROKER="+o.broker)
	cmd.Stdout = io.Discard
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	atForcedExit(func() { _ = cmd.Process.Kill() })
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	// kill returns the exit status of a process killed on purpose, which
	// says nothing more.
	kill := func() error {
		_ = cmd.Process.Kill()
		return <-exited
	}
	count := func() (n int64, err error) {
		err = pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE consumer = $1`, o.name).Scan(&n)
		return n, err
	}
	deadline := time.After(2 * time.Minute)
	for {
		n, err := count()
		if err != nil {
			_ = kill()
			return 0, err
		}
		if n >= int64(target) {
			break
		}
		select {
		case err := <-exited:
			return 0, fmt.Errorf("run 1 exited before it was killed: %w", err)
		case <-deadline:
			_ = kill()
			return 0, errors.New("run 1 did not commit half the events within 2 minutes")
		case <-ctx.Done():
			_ = kill()
			return 0, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	_ = kill()
	if isTerminal(stderr) {
		fmt.Fprintln(stderr)
	}
	return count()
}

// settled reports whether every message the consumer received has ended:
// handled, skipped, or dead-lettered.
func settled(s consumer.Stats) bool {
	return s.Handled+s.Duplicates+s.Skipped+s.DeadLettered == s.Received
}

// waitDrained waits until the broker has nothing left for the consumer
// (Kafka: the group's committed offsets are at the end of every partition;
// RabbitMQ: no message ready) and the consumer has settled all it received,
// twice in a row 200 ms apart: RabbitMQ counts the messages pushed to the
// consumer and not yet acked as not ready.
func waitDrained(ctx context.Context, c *consumer.Consumer[OrderEvent], lag func(context.Context) (int64, error), errc <-chan error) error {
	deadline := time.After(3 * time.Minute)
	var prev consumer.Stats
	streak := 0
	for {
		n, err := lag(ctx)
		if err != nil {
			return err
		}
		s := c.Stats()
		if n == 0 && settled(s) && s == prev {
			streak++
		} else {
			streak = 0
		}
		if streak >= 2 {
			return nil
		}
		prev = s
		select {
		case err := <-errc:
			if err == nil {
				err = errors.New("the consumer stopped before the queue was drained")
			}
			return err
		case <-deadline:
			return fmt.Errorf("the consumer did not drain the queue within 3 minutes (lag %d, %+v)", n, s)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// uniqueEvents is the number of valid, distinct events: each must be
// handled exactly once.
func (p *Plan) uniqueEvents() int { return p.Sent[kindEvent] + p.Sent[kindIDless] }

// sentSummary lists the messages sent by kind.
func (p *Plan) sentSummary() string {
	var parts []string
	for _, k := range kindOrder {
		if p.Sent[k] > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", p.Sent[k], k))
		}
	}
	return strings.Join(parts, ", ")
}

// report compares the database and the dead-letter queue with the plan,
// prints the comparison and a verdict, and returns an error when anything
// differs.
func report(ctx context.Context, w io.Writer, pool *pgxpool.Pool, o *options, plan *Plan, r runs,
	dlq []deadLetter, elapsed time.Duration) error {
	// The orders table, row by row, with each order's payments.
	rows, err := pool.Query(ctx, `SELECT o.id, o.status, o.amount_cents, count(p.order_id), coalesce(sum(p.amount_cents), 0)
		FROM orders o LEFT JOIN payments p ON p.order_id = o.id GROUP BY o.id`)
	if err != nil {
		return err
	}
	byStatus := map[string]int{}
	var mismatches []string
	seen := map[string]bool{}
	nOrders := 0
	for rows.Next() {
		var id, status string
		var amount, paidSum int64
		var payments int
		if err := rows.Scan(&id, &status, &amount, &payments, &paidSum); err != nil {
			rows.Close()
			return err
		}
		nOrders++
		byStatus[status]++
		seen[id] = true
		want, ok := plan.Orders[id]
		wantPayments, wantSum := 0, int64(0)
		if want.Paid {
			wantPayments, wantSum = 1, want.AmountCents
		}
		switch {
		case !ok:
			mismatches = append(mismatches, fmt.Sprintf("%s: in the table, never created", id))
		case status != want.Status || amount != want.AmountCents:
			mismatches = append(mismatches, fmt.Sprintf("%s: %s %d, want %s %d", id, status, amount, want.Status, want.AmountCents))
		case payments != wantPayments || paidSum != wantSum:
			mismatches = append(mismatches, fmt.Sprintf("%s: %d payments for %d, want %d for %d", id, payments, paidSum, wantPayments, wantSum))
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	for id := range plan.Orders {
		if !seen[id] {
			mismatches = append(mismatches, fmt.Sprintf("%s: missing", id))
		}
	}
	wantStatus := map[string]int{}
	for _, e := range plan.Orders {
		wantStatus[e.Status]++
	}
	var ledgerRows, processed int64
	var ledgerSum int64
	if err := pool.QueryRow(ctx, `SELECT count(*), coalesce(sum(amount_cents), 0) FROM payments`).Scan(&ledgerRows, &ledgerSum); err != nil {
		return err
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE consumer = $1`, o.name).Scan(&processed); err != nil {
		return err
	}

	// Dead letters are at least once (a poison message whose ack was lost
	// is dead-lettered again when redelivered): count distinct event ids,
	// leaving out those a replay has since handled.
	dlIDs := map[string]string{} // event id -> kind
	// byRule: dead-lettered at least once by a cause that does not pass
	// (each record counts, not the id's last one).
	byRule := map[string]bool{}
	var ids []string
	for _, d := range dlq {
		id := d.Headers[consumer.HeaderEventID]
		if _, ok := dlIDs[id]; !ok {
			ids = append(ids, id)
		}
		dlIDs[id] = d.Headers[consumer.HeaderErrorKind]
		if !waitedForOrder(d) && !causeUnknown(d) {
			byRule[id] = true
		}
	}
	var handled []string
	if err := pool.QueryRow(ctx, `SELECT coalesce(array_agg(event_id), '{}') FROM processed_events WHERE consumer = $1 AND event_id = ANY($2)`,
		o.name, ids).Scan(&handled); err != nil {
		return err
	}
	// A dead letter whose event was handled after all is resolved when its
	// cause passes: its order had not arrived (it was replayed, or a copy
	// came later), or it was in flight at repeated crashes (crash-loop,
	// replayed). Dead-lettered by any other rule, the handler ran for an
	// event that had been handled: a copy the claim did not skip, which
	// the rule, not the claim, kept from doubling the effect.
	var resolved, rerun []string
	for _, id := range handled {
		if byRule[id] {
			rerun = append(rerun, id)
		} else {
			resolved = append(resolved, id)
		}
		delete(dlIDs, id)
	}
	dlKinds := map[string]int{}
	for _, k := range dlIDs {
		dlKinds[k]++
	}
	wantKinds := map[string]int{string(consumer.KindDecode): plan.Malformed, string(consumer.KindHandler): plan.Violations}

	fmt.Fprintln(w)
	fmt.Fprintf(w, "sent              %6d  messages to %s (%s)\n", len(plan.Messages), o.broker, o.topic)
	for _, k := range kindOrder {
		if n := plan.Sent[k]; n > 0 {
			fmt.Fprintf(w, "  %-22s%6d\n", k, n)
		}
	}
	if o.crash {
		fmt.Fprintf(w, "run 1             %6d  events committed, then SIGKILL (no drain; what it had not acked is delivered again)\n", r.killed)
	}
	fmt.Fprintf(w, "run 2             %6d  received: %d handled, %d duplicates skipped, %d dead-lettered, %d retries\n",
		r.second.Received, r.second.Handled, r.second.Duplicates, r.second.DeadLettered, r.second.Retries)
	if r.third != nil {
		fmt.Fprintf(w, "run 3 (replay)    %6d  received: %d handled, %d duplicates skipped, %d dead-lettered again\n",
			r.third.Received, r.third.Handled, r.third.Duplicates, r.third.DeadLettered)
	}
	fmt.Fprintf(w, "processed events  %6d  (want %d: every valid event once, duplicates and copies without ids skipped)\n",
		processed, plan.uniqueEvents())
	r.web.print(w)
	fmt.Fprintf(w, "orders            %6d  (want %d) %s (want %s)\n", nOrders, len(plan.Orders), statusList(byStatus), statusList(wantStatus))
	fmt.Fprintf(w, "payments          %6d  (want %d, one per paid order)\n", ledgerRows, plan.LedgerRows)
	fmt.Fprintf(w, "ledger sum    %10d  (want %d)\n", ledgerSum, plan.LedgerSum)
	fmt.Fprintf(w, "dead-lettered     %6d  %s (want %s; %d records: dead letters are at least once)\n",
		len(dlIDs), kindList(dlKinds), kindList(wantKinds), len(dlq))
	if len(resolved) > 0 {
		fmt.Fprintf(w, "  replayed        %6d  dead letters handled after their order arrived, not counted above\n", len(resolved))
	}
	if len(rerun) > 0 {
		sort.Strings(rerun)
		fmt.Fprintf(w, "  handled twice   %6d  events handled, then dead-lettered by a rule when a copy ran the handler again (want 0), e.g. %s\n",
			len(rerun), rerun[0])
	}
	printReplayCommand(w, o, dlq, dlIDs)
	hop2OK := true
	if o.shipping {
		c, err := countHop2(ctx, pool, o)
		if err != nil {
			return err
		}
		wire, err := countWire(o)
		if err != nil {
			return fmt.Errorf("read %s: %w", confirmedName(o), err)
		}
		shipping := &r.shipping
		if *shipping == (consumer.Stats{}) {
			shipping = nil // the chaos driver's check: its members' counts are in their logs
		}
		c.print(w, shipping, wire)
		hop2OK = c.ok() && c.PaidOrders == int64(plan.LedgerRows) && (wire == nil || wire.IDs == int(c.PaidOrders))
	}
	fmt.Fprintf(w, "elapsed       %10s  (publish and all runs)\n", elapsed.Round(time.Millisecond))
	for i, m := range mismatches {
		if i == 5 {
			fmt.Fprintf(w, "  ... and %d more mismatched orders\n", len(mismatches)-5)
			break
		}
		fmt.Fprintf(w, "  mismatch: %s\n", m)
	}

	ok := len(mismatches) == 0 && nOrders == len(plan.Orders) &&
		ledgerRows == int64(plan.LedgerRows) && ledgerSum == plan.LedgerSum &&
		processed == int64(plan.uniqueEvents()) &&
		len(dlIDs) == plan.Malformed+plan.Violations && kindList(dlKinds) == kindList(wantKinds) && len(rerun) == 0 && r.web.ok()
	if !ok {
		fmt.Fprintln(w, "verdict: FAIL: the database or the dead-letter queue does not match what was sent")
		return errors.New("verdict: FAIL")
	}
	if !hop2OK {
		fmt.Fprintln(w, "verdict: FAIL: the second hop: a paid order not confirmed, published or shipped exactly once")
		return errors.New("verdict: FAIL (hop 2)")
	}
	if o.shipping {
		fmt.Fprintln(w, "verdict: PASS: every order exactly right, each payment once, every bad message dead-lettered, nothing lost;")
		fmt.Fprintln(w, "         hop 2: each paid order confirmed once through the outbox, published (copies share its id), shipped once")
		return nil
	}
	fmt.Fprintln(w, "verdict: PASS: every order exactly right, each payment once, every bad message dead-lettered, nothing lost")
	return nil
}

// waitedForOrder reports whether d failed only because its order did not
// exist yet (ErrUnknownOrder past the retries): a cause that passes.
// causeUnknown reports whether d's cause is not known to be a rule's: a
// crash loop, or runs spent by failures in processes that ended before
// dead-lettering the message, whose crash-guard record kept no error (one
// written by a release before dedup schema version 5). Such a cause may
// have passed.
func causeUnknown(d deadLetter) bool {
	return d.Headers[consumer.HeaderErrorKind] == string(consumer.KindCrashLoop) ||
		strings.Contains(d.Headers[consumer.HeaderErrorMessage], runsSpentText)
}

// runsSpentText is in the error of the consumer's dead letter for a message
// whose runs were spent in processes that ended before dead-lettering it.
const runsSpentText = "the last error is not known"

func waitedForOrder(d deadLetter) bool {
	return d.Headers[consumer.HeaderErrorKind] == string(consumer.KindHandler) &&
		strings.Contains(d.Headers[consumer.HeaderErrorMessage], ErrUnknownOrder.Error())
}

// printReplayCommand says how many dead letters could be put back once
// their cause is gone (payments and cancellations whose order had not
// arrived), and the once command that redrives them through the
// consumer's deduplication.
func printReplayCommand(w io.Writer, o *options, dlq []deadLetter, pending map[string]string) {
	waiting := map[string]bool{} // each event once: dead letters are at least once
	for _, d := range dlq {
		id := d.Headers[consumer.HeaderEventID]
		if _, ok := pending[id]; ok && waitedForOrder(d) {
			waiting[id] = true
		}
	}
	broker := "-kafka " + strings.Join(o.kafkaBrokers, ",")
	if o.broker == "amqp" {
		broker = `-amqp "$AMQP_URL"`
	}
	fmt.Fprintf(w, "dead letters      %6d  records in %s.dlq; %d failed for want of their order: once it exists, put them back with\n",
		len(dlq), o.topic, len(waiting))
	fmt.Fprintf(w, "                  once dlq replay %s -dlq %s.dlq -consumer %s -kind handler -search %q\n",
		broker, o.topic, o.name, ErrUnknownOrder.Error())
}

func statusList(m map[string]int) string {
	return fmt.Sprintf("created=%d paid=%d cancelled=%d", m["created"], m["paid"], m["cancelled"])
}

func kindList(m map[string]int) string {
	var parts []string
	for k, v := range m {
		if v > 0 {
			parts = append(parts, fmt.Sprintf("%s=%d", k, v))
		}
	}
	sort.Strings(parts)
	return "[" + strings.Join(parts, " ") + "]"
}
