package bench

// The outbox rows: for each broker, the relay's throughput next to the
// broker's confirmed-publish ceiling measured in the same run (the same
// messages, in batches of the relay's size, straight to the broker: Kafka
// through a sarama idempotent producer with acks=all, RabbitMQ through
// amqp091 with publisher confirms), then the latency from a writer's
// commit to the commit of a consumer of this library downstream, with
// rows written at half the relay's measured rate.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/amqpout"
	"github.com/onceco/once/outbox/kafkaout"
)

// OutboxResult is one broker's outbox rows.
type OutboxResult struct {
	Broker    Broker `json:"broker"`
	Rows      int    `json:"rows"`
	BatchSize int    `json:"batch_size"`
	// Rounds is how many times the ceiling and the relay alternate, each
	// with Rows/Rounds messages: ceiling, relay, ceiling, relay, ...,
	// ceiling. The machine's other load moves between measurements; each
	// relay measurement is compared with the higher of the ceilings
	// measured just before and just after it.
	Rounds int `json:"rounds"`
	// CeilingRates are the ceiling's measurements: the broker's confirmed
	// publish of the same messages in batches of BatchSize, with no
	// database. CeilingRate is their median.
	CeilingRates []float64 `json:"ceiling_runs_msgs_per_s"`
	CeilingRate  float64   `json:"ceiling_msgs_per_s"`
	// RelayRates are the relay's measurements: rows written beforehand,
	// published and deleted by one relay, per second. RelayRate is their
	// median.
	RelayRates []float64 `json:"relay_runs_msgs_per_s"`
	RelayRate  float64   `json:"relay_msgs_per_s"`
	// VsCeiling is the median over the rounds of the relay's rate over
	// the higher of its two neighbouring ceilings.
	VsCeiling float64 `json:"x_ceiling"`
	// P50Ms and P99Ms are from the commit of the transaction that wrote a
	// row to the commit of the downstream consumer's transaction that
	// handled it, at PacedRate rows/s (half of RelayRate, capped by
	// Options.PaceMax), the first sixth excluded as warm-up.
	P50Ms float64 `json:"p50_ms"`
	P99Ms float64 `json:"p99_ms"`
	// ConfirmP50Ms and ConfirmP99Ms are the relay's share: from the
	// writer's commit to the broker's confirm of the row's publish.
	ConfirmP50Ms float64 `json:"confirm_p50_ms"`
	ConfirmP99Ms float64 `json:"confirm_p99_ms"`
	PacedTarget  float64 `json:"paced_target_msgs_per_s"`
	PacedRate    float64 `json:"paced_msgs_per_s"`
	PacedMsgs    int     `json:"paced_messages"`
	// Correct says whether every row reached the broker and the outbox
	// was left empty; Check says what was counted.
	Correct bool   `json:"correct"`
	Check   string `json:"check"`
	// Error says why the row failed (Correct is then false); the figures
	// are those measured before it failed. Empty when it ran to its end.
	Error string `json:"error,omitempty"`
}

// outboxBody is a ~200-byte payload, like the consumer rows'.
func outboxBody(i int) []byte {
	return []byte(fmt.Sprintf(`{"n":%d,"account":"acct-%d","amount":%d,"pad":"%s"}`, i, i%256, 100+i%1000, pad))
}

// outboxKey spreads rows over 256 keys: per-key order is what the relay
// keeps, so the keys must repeat.
func outboxKey(i int) []byte { return []byte("acct-" + strconv.Itoa(i%256)) }

// outboxDest is where a broker's outbox rows go.
type outboxDest struct {
	b         Broker
	kc        *kafkaCluster
	amqpURL   string
	name      string // Kafka topic, or RabbitMQ queue (default exchange)
	partition int
}

func (d *outboxDest) message(prefix string, i int) outbox.Message {
	m := outbox.Message{ID: prefix + strconv.Itoa(i), Key: outboxKey(i), Type: "bench.outbox", Body: outboxBody(i)}
	if d.b == RabbitMQ {
		m.RoutingKey = d.name
	} else {
		m.Topic = d.name
	}
	return m
}

// create makes the destination (and its dead-letter topic or queue, for
// the downstream consumer).
func (d *outboxDest) create() error {
	if d.b == RabbitMQ {
		return declareQueue(d.amqpURL, d.name, nil)
	}
	return d.kc.createTopics(d.name, d.partition)
}

// count returns the messages at the destination.
func (d *outboxDest) count() (int, error) {
	if d.b == RabbitMQ {
		return queueLength(d.amqpURL, d.name)
	}
	return topicCount(d.kc.addrs, d.name)
}

// checkPublished counts the messages the relay rounds left at d, and how
// many of them are not the rows of the rounds (per rows each, ids
// r<round>-<i>), each row once.
func checkPublished(d *outboxDest, rounds, per int) (published, wrong int, err error) {
	if published, err = d.count(); err != nil {
		return 0, 0, err
	}
	var got []string
	if d.b == RabbitMQ {
		got, err = queueIDs(d.amqpURL, d.name, published)
	} else {
		got, err = topicIDs(d.kc.addrs, d.name)
	}
	if err != nil {
		return 0, 0, fmt.Errorf("published ids: %w", err)
	}
	want := make([]string, 0, rounds*per)
	for round := range rounds {
		for i := range per {
			want = append(want, d.message(fmt.Sprintf("r%d-", round), i).ID)
		}
	}
	return published, unmatched(got, want), nil
}

// queueLength returns the ready messages of queue.
func queueLength(url, queue string) (int, error) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return 0, fmt.Errorf("queue %s: %w", queue, err)
	}
	return q.Messages, nil
}

func (d *outboxDest) cleanup() {
	if d.b == RabbitMQ {
		deleteQueues(d.amqpURL, d.name)
	}
}

// publisher is the relay's publisher for the destination.
func (d *outboxDest) publisher() (outbox.Publisher, func() error, error) {
	if d.b == RabbitMQ {
		p, err := amqpout.New(amqpout.Config{URL: d.amqpURL})
		if err != nil {
			return nil, nil, err
		}
		return p, p.Close, nil
	}
	p, err := kafkaout.New(kafkaout.Config{Brokers: d.kc.addrs, Sarama: saramaConfig()})
	if err != nil {
		return nil, nil, err
	}
	return p, p.Close, nil
}

// runOutbox measures the outbox rows of broker b. When it fails, it
// returns what it measured before with the error.
func runOutbox(ctx context.Context, db *pgxpool.Pool, kc *kafkaCluster, o Options, b Broker) (*OutboxResult, error) {
	res := &OutboxResult{Broker: b, Rows: o.OutboxRows, BatchSize: outbox.DefaultBatchSize, Rounds: outboxRounds}
	schema := schemaName(b, "outbox")
	if err := createSchema(ctx, db, schema); err != nil {
		return res, err
	}
	defer dropSchema(db, schema)
	pool, err := schemaPool(ctx, o.DatabaseURL, schema)
	if err != nil {
		return res, err
	}
	defer pool.Close()
	if err := outbox.Migrate(ctx, pool); err != nil {
		return res, err
	}
	stamp := strconv.FormatInt(time.Now().UnixNano(), 10)
	newDest := func(what string) (*outboxDest, error) {
		d := &outboxDest{b: b, kc: kc, amqpURL: o.AMQPURL, name: "oncebench-outbox-" + what + "-" + stamp, partition: o.Workload.Partitions}
		return d, d.create()
	}

	ceil, err := newDest("ceiling")
	if err != nil {
		return res, err
	}
	defer ceil.cleanup()
	rel, err := newDest("relay")
	if err != nil {
		return res, err
	}
	defer rel.cleanup()
	if err := measureOutbox(ctx, o, pool, ceil, rel, res); err != nil {
		return res, err
	}
	published, wrong, err := checkPublished(rel, res.Rounds, res.Rows/res.Rounds)
	if err != nil {
		return res, err
	}

	if o.Pace > 0 {
		paced, err := newDest("paced")
		if err != nil {
			return res, err
		}
		defer paced.cleanup()
		res.PacedTarget = min(res.RelayRate/2, o.PaceMax)
		if err := outboxLatency(ctx, pool, paced, o.Pace, res); err != nil {
			return res, fmt.Errorf("latency: %w", err)
		}
		o.logf("  %-9s %-19s p50/p99 %.1f/%.1f ms commit to downstream commit (%.1f/%.1f ms to the broker's confirm) at %.0f rows/s",
			b, "outbox latency", res.P50Ms, res.P99Ms, res.ConfirmP50Ms, res.ConfirmP99Ms, res.PacedRate)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&left); err != nil {
		return res, err
	}
	res.Correct = published == res.Rows && wrong == 0 && left == 0
	res.Check = fmt.Sprintf("%d/%d at the broker, %d rows left", published, res.Rows, left)
	if wrong > 0 {
		res.Check += fmt.Sprintf(", %d at the broker not one of the rows", wrong)
	}
	if res.CeilingRate <= 0 {
		return res, errors.New("the ceiling measured no throughput")
	}
	return res, nil
}

// outboxRounds is how many times the ceiling and the relay alternate.
const outboxRounds = 3

// measureOutbox alternates the ceiling and the relay (see
// OutboxResult.Rounds) and fills the rates and the ratio.
func measureOutbox(ctx context.Context, o Options, pool *pgxpool.Pool, ceil, rel *outboxDest, res *OutboxResult) error {
	res.Rounds = outboxRounds
	per := max(1, res.Rows/res.Rounds)
	res.Rows = per * res.Rounds
	ceiling := func() error {
		rate, err := outboxCeiling(ceil, per, res.BatchSize)
		if err != nil {
			return fmt.Errorf("ceiling: %w", err)
		}
		res.CeilingRates = append(res.CeilingRates, rate)
		o.logf("  %-9s %-19s %9.0f msgs/s  (confirmed publish, batches of %d, no database)", res.Broker, "outbox ceiling", rate, res.BatchSize)
		return nil
	}
	if err := ceiling(); err != nil {
		return err
	}
	var ratios []float64
	for round := range res.Rounds {
		rate, err := outboxRelayRate(ctx, pool, rel, per, fmt.Sprintf("r%d-", round))
		if err != nil {
			return fmt.Errorf("relay: %w", err)
		}
		res.RelayRates = append(res.RelayRates, rate)
		if err := ceiling(); err != nil {
			return err
		}
		ratio := rate / max(res.CeilingRates[round], res.CeilingRates[round+1])
		ratios = append(ratios, ratio)
		o.logf("  %-9s %-19s %9.0f msgs/s  (%.2fx the higher ceiling beside it)", res.Broker, "outbox relay", rate, ratio)
	}
	res.CeilingRate, res.RelayRate, res.VsCeiling = median(res.CeilingRates), median(res.RelayRates), median(ratios)
	return nil
}

// median returns the median of xs (the mean of the middle two for an
// even count).
func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// schemaPool opens a pool whose search_path is schema.
func schemaPool(ctx context.Context, url, schema string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = 8
	return pgxpool.NewWithConfig(ctx, cfg)
}

// outboxCeiling publishes n messages to d in batches of batch, waiting for
// each batch's confirms, and returns the rate.
func outboxCeiling(d *outboxDest, n, batch int) (float64, error) {
	if d.b == RabbitMQ {
		return amqpCeiling(d, n, batch)
	}
	sc := saramaConfig()
	sc.Producer.Idempotent = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Return.Successes = true
	sc.Producer.Return.Errors = true
	sc.Net.MaxOpenRequests = 1
	p, err := sarama.NewSyncProducer(d.kc.addrs, sc)
	if err != nil {
		return 0, err
	}
	defer p.Close()
	msgs := make([]*sarama.ProducerMessage, 0, batch)
	start := time.Now()
	for from := 0; from < n; from += batch {
		msgs = msgs[:0]
		for i := from; i < min(from+batch, n); i++ {
			m := d.message("c-", i)
			msgs = append(msgs, &sarama.ProducerMessage{Topic: d.name, Key: sarama.ByteEncoder(m.Key), Value: sarama.ByteEncoder(m.Body),
				Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(m.ID)}, {Key: []byte("type"), Value: []byte(m.Type)}}})
		}
		if err := p.SendMessages(msgs); err != nil {
			return 0, err
		}
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// amqpCeiling publishes n persistent, mandatory messages to d's queue in
// confirm mode, batch at a time.
func amqpCeiling(d *outboxDest, n, batch int) (float64, error) {
	conn, err := amqp091.Dial(d.amqpURL)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	if err := ch.Confirm(false); err != nil {
		return 0, err
	}
	ctx := context.Background()
	confirms := make([]*amqp091.DeferredConfirmation, 0, batch)
	start := time.Now()
	for from := 0; from < n; from += batch {
		confirms = confirms[:0]
		for i := from; i < min(from+batch, n); i++ {
			m := d.message("c-", i)
			dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", d.name, true, false, amqp091.Publishing{
				DeliveryMode: amqp091.Persistent, MessageId: m.ID, Type: m.Type, Body: m.Body,
				Headers: amqp091.Table{"key": string(m.Key)}})
			if err != nil {
				return 0, err
			}
			confirms = append(confirms, dc)
		}
		for _, dc := range confirms {
			ok, err := dc.WaitContext(ctx)
			if err != nil {
				return 0, err
			}
			if !ok {
				return 0, errors.New("RabbitMQ nacked a message")
			}
		}
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// countingPublisher counts the records its publisher confirmed.
type countingPublisher struct {
	outbox.Publisher
	confirmed atomic.Int64
}

func (c *countingPublisher) Publish(ctx context.Context, recs []outbox.Record) []error {
	errs := c.Publisher.Publish(ctx, recs)
	ok := int64(len(recs))
	for _, err := range errs {
		if err != nil {
			ok--
		}
	}
	c.confirmed.Add(ok)
	return errs
}

// outboxRelayRate writes n rows (ids prefix + number), then times one
// relay publishing and deleting all of them.
func outboxRelayRate(ctx context.Context, pool *pgxpool.Pool, d *outboxDest, n int, prefix string) (float64, error) {
	for from := 0; from < n; from += 1000 {
		msgs := make([]outbox.Message, 0, 1000)
		for i := from; i < min(from+1000, n); i++ {
			msgs = append(msgs, d.message(prefix, i))
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return outbox.Add(ctx, tx, msgs...) }); err != nil {
			return 0, err
		}
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE outbox`); err != nil {
		return 0, err
	}
	pub, closePub, err := d.publisher()
	if err != nil {
		return 0, err
	}
	defer func() { _ = closePub() }()
	counted := &countingPublisher{Publisher: pub}
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	start := time.Now()
	relayDone, err := startBenchRelay(rctx, pool, counted)
	if err != nil {
		return 0, err
	}
	if err := awaitEmptyOutbox(ctx, pool, func() bool { return counted.confirmed.Load() >= int64(n) }, time.Minute+time.Duration(n)*time.Millisecond); err != nil {
		return 0, err
	}
	rate := float64(n) / time.Since(start).Seconds()
	stop()
	<-relayDone
	return rate, nil
}

// startBenchRelay runs a relay with the default settings on pool's outbox
// until ctx ends; the channel closes when it has returned.
func startBenchRelay(ctx context.Context, pool *pgxpool.Pool, pub outbox.Publisher) (<-chan struct{}, error) {
	r, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{SkipMigrate: true, Logger: quietLogger()})
	if err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = r.Run(ctx)
	}()
	return done, nil
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// awaitEmptyOutbox waits until confirmed says the broker has every row,
// then until the relay has deleted them all.
func awaitEmptyOutbox(ctx context.Context, pool *pgxpool.Pool, confirmed func() bool, within time.Duration) error {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		if confirmed() {
			var left int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&left); err != nil {
				return err
			}
			if left == 0 {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	return fmt.Errorf("the relay did not empty the outbox within %s", within)
}

// outboxLatency writes rows at res.PacedTarget a second for pace, with a
// relay publishing them and a consumer of this library handling them
// downstream, and records each row's time from its writer's commit to the
// downstream commit.
func outboxLatency(ctx context.Context, pool *pgxpool.Pool, d *outboxDest, pace time.Duration, res *OutboxResult) error {
	// Each row's two commits, by id: the downstream one may be recorded
	// before its writer's.
	var mu sync.Mutex
	written, confirmed, downstream := map[string]time.Time{}, map[string]time.Time{}, map[string]time.Time{}
	afterCommit := func(_ context.Context, evs []consumer.Committed) {
		now := time.Now()
		mu.Lock()
		defer mu.Unlock()
		for _, ev := range evs {
			downstream[ev.EventID] = now
		}
	}
	c, err := downstreamConsumer(ctx, pool, d, afterCommit)
	if err != nil {
		return err
	}
	pub, closePub, err := d.publisher()
	if err != nil {
		return err
	}
	defer func() { _ = closePub() }()
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	stamped := &stampingPublisher{Publisher: pub, stamp: func(ids []string, at time.Time) {
		mu.Lock()
		defer mu.Unlock()
		for _, id := range ids {
			if _, ok := confirmed[id]; !ok {
				confirmed[id] = at
			}
		}
	}}
	relayDone, err := startBenchRelay(rctx, pool, stamped)
	if err != nil {
		return err
	}
	// consumerDone reports the consumer's early stop to the waits below;
	// consumerStopped tells the deferred cleanup that it has returned.
	consumerDone, consumerStopped := make(chan error, 1), make(chan struct{})
	go func() {
		defer close(consumerStopped)
		consumerDone <- c.Run(rctx)
	}()
	defer func() { stop(); <-relayDone; <-consumerStopped }()

	// One row through both hops first: the downstream consumer joins its
	// group (Apache Kafka holds a new group for its initial rebalance
	// delay) before the paced rows start.
	warm := d.message("w-", 0)
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return outbox.Add(ctx, tx, warm) }); err != nil {
		return err
	}
	if err := awaitDownstream(func() bool { mu.Lock(); defer mu.Unlock(); _, ok := downstream[warm.ID]; return ok }, consumerDone); err != nil {
		return fmt.Errorf("warm-up row: %w", err)
	}
	n, elapsed, err := paceOutboxWriters(ctx, pool, d, res.PacedTarget, pace, func(ids []string, at time.Time) {
		mu.Lock()
		for _, id := range ids {
			written[id] = at
		}
		mu.Unlock()
	})
	if err != nil {
		return err
	}
	res.PacedMsgs, res.PacedRate = n, float64(n)/elapsed.Seconds()
	if err := awaitDownstream(func() bool { mu.Lock(); defer mu.Unlock(); return len(downstream) >= n+1 }, consumerDone); err != nil {
		return fmt.Errorf("paced rows: %w", err)
	}
	mu.Lock()
	defer mu.Unlock()
	var lat, toConfirm []time.Duration
	for i := n / 6; i < n; i++ { // the first sixth is the warm-up
		id := d.message("p-", i).ID
		lat = append(lat, downstream[id].Sub(written[id]))
		toConfirm = append(toConfirm, confirmed[id].Sub(written[id]))
	}
	if len(lat) == 0 {
		return errors.New("no row was written in the paced phase")
	}
	res.P50Ms, res.P99Ms = percentiles(lat)
	res.ConfirmP50Ms, res.ConfirmP99Ms = percentiles(toConfirm)
	return nil
}

// percentiles returns the p50 and p99 of ds in milliseconds, by the
// nearest-rank method as the consumer rows' (percentile); it sorts ds.
func percentiles(ds []time.Duration) (p50, p99 float64) {
	slices.Sort(ds)
	return ms(percentile(ds, 0.50)), ms(percentile(ds, 0.99))
}

// stampingPublisher reports the time the broker confirmed each record.
type stampingPublisher struct {
	outbox.Publisher
	stamp func(ids []string, at time.Time)
}

func (s *stampingPublisher) Publish(ctx context.Context, recs []outbox.Record) []error {
	errs := s.Publisher.Publish(ctx, recs)
	at := time.Now()
	ids := make([]string, 0, len(recs))
	for i, rec := range recs {
		if errs == nil || errs[i] == nil {
			ids = append(ids, rec.EventID)
		}
	}
	s.stamp(ids, at)
	return errs
}

// awaitDownstream waits, at most a minute, until done reports true; it
// fails if the downstream consumer stops first.
func awaitDownstream(done func() bool, consumerDone <-chan error) error {
	deadline := time.Now().Add(time.Minute)
	for !done() {
		if time.Now().After(deadline) {
			return errors.New("the downstream consumer did not commit them within a minute")
		}
		select {
		case err := <-consumerDone:
			return fmt.Errorf("the downstream consumer stopped: %w", err)
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}

// downstreamConsumer is a consumer of this library on d, with the library's
// defaults, writing one business row per message.
func downstreamConsumer(ctx context.Context, pool *pgxpool.Pool, d *outboxDest, afterCommit func(context.Context, []consumer.Committed)) (*consumer.Consumer[[]byte], error) {
	spec := &rowSpec{Brokers: d.kc.addrsOrNil(), Topic: d.name, Group: d.name + "-group", AMQPURL: d.amqpURL, Queue: d.name}
	var src consumer.Source
	var err error
	if d.b == RabbitMQ {
		src, err = openAMQPSource(ctx, spec, quietLogger())
	} else {
		src, err = openKafkaSource(ctx, spec, quietLogger())
	}
	if err != nil {
		return nil, err
	}
	handle := func(_ context.Context, _ pgx.Tx, ev consumer.Event[[]byte]) error {
		ev.Queue(`INSERT INTO effects (event_id, n, account, amount) VALUES ($1, 0, '', 0)`, ev.ID)
		return nil
	}
	c, err := consumer.New(pool, src, handle, consumer.Config{Name: "outbox-downstream",
		Telemetry: consumer.TelemetryConfig{Logger: quietLogger()}, Hooks: consumer.Hooks{AfterCommit: afterCommit}})
	if err != nil {
		_ = src.Close()
		return nil, err
	}
	return c, nil
}

func (c *kafkaCluster) addrsOrNil() []string {
	if c == nil {
		return nil
	}
	return c.addrs
}

// outboxWriters is how many writers share the paced rate: one
// transaction at a time each.
const outboxWriters = 4

// paceOutboxWriters writes rows at rate a second for d, from
// outboxWriters goroutines, each transaction holding the rows due since
// the writer's previous one, and reports each transaction's rows with the
// time its commit returned. It returns the rows written and how long it
// took.
func paceOutboxWriters(ctx context.Context, pool *pgxpool.Pool, d *outboxDest, rate float64, pace time.Duration,
	onCommit func(ids []string, at time.Time)) (int, time.Duration, error) {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, outboxWriters)
	start := time.Now()
	for w := range outboxWriters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[w] = paceWriter(ctx, pool, d, start, rate, pace, &next, onCommit)
		}()
	}
	wg.Wait()
	return int(next.Load()), time.Since(start), errors.Join(errs...)
}

// paceWriter is one paced writer: every millisecond it takes the rows due
// by the shared schedule (next counts the rows taken by every writer) and
// writes them in one transaction.
func paceWriter(ctx context.Context, pool *pgxpool.Pool, d *outboxDest, start time.Time, rate float64, pace time.Duration,
	next *atomic.Int64, onCommit func(ids []string, at time.Time)) error {
	const maxPerTx = 500
	for {
		elapsed := time.Since(start)
		if elapsed >= pace {
			return nil
		}
		due := int64(rate * elapsed.Seconds())
		from := next.Load()
		n := min(due-from, maxPerTx)
		if n <= 0 || !next.CompareAndSwap(from, from+n) {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(time.Millisecond):
			}
			continue
		}
		msgs := make([]outbox.Message, n)
		ids := make([]string, n)
		for i := range n {
			msgs[i] = d.message("p-", int(from+i))
			ids[i] = msgs[i].ID
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return outbox.Add(ctx, tx, msgs...) }); err != nil {
			return err
		}
		onCommit(ids, time.Now())
	}
}
