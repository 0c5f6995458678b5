// Command order-processor is a small order service written the way we want
// users of once to write theirs. It consumes order events (order.created,
// order.paid, order.cancelled) from Kafka or RabbitMQ, one typed handler per
// event type through a consumer.Router, and keeps an orders table and a
// payments ledger in PostgreSQL exactly right: each order created once, paid
// once, cancellations only of unpaid orders.
//
// Usage:
//
//	order-processor [demo] [flags]   generate traffic, consume it with a crash in the middle, print a verdict
//	order-processor serve [flags]    consume until SIGINT/SIGTERM
//	order-processor produce [flags]  publish generated traffic to a running broker
//
// With no addresses in the environment it starts what it needs itself: an
// in-process Kafka-protocol broker (kfake) on a loopback port it prints, so
// kcat or any Kafka client can produce to it, and a throwaway PostgreSQL
// server removed on exit. KAFKA_BROKERS (comma-separated), AMQP_URL and
// DATABASE_URL point it at real servers; -broker (or BROKER) chooses kafka or
// amqp.
//
// See docs/getting-started.md for a walk through the code and the report.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/backoff"
	"github.com/onceco/once/internal/pgtemp"
)

func main() {
	ctx := signalContext()
	os.Exit(realMain(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// forced holds what must run even when a second signal ends the process at
// once: stopping the throwaway PostgreSQL server, a separate process.
var forced struct {
	sync.Mutex
	fns []func()
}

// atForcedExit registers f to run before a forced exit, after the functions
// registered later.
func atForcedExit(f func()) {
	forced.Lock()
	defer forced.Unlock()
	forced.fns = append(forced.fns, f)
}

// signalContext returns a context cancelled by the first SIGINT or SIGTERM:
// the consumer then stops receiving, finishes and commits what is in flight,
// and acks it. A second signal exits at once (what was not acked is
// redelivered to the next run and recognised as a duplicate if it had
// committed).
func signalContext() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan os.Signal, 2)
	signal.Notify(ch, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-ch
		fmt.Fprintln(os.Stderr, "\nshutting down: finishing the messages in flight (a second signal exits at once)")
		cancel()
		<-ch
		fmt.Fprintln(os.Stderr, "second signal: exiting now; unacked messages will be redelivered")
		forced.Lock()
		fns := forced.fns
		forced.Unlock()
		done := make(chan struct{})
		go func() {
			for i := len(fns) - 1; i >= 0; i-- {
				fns[i]()
			}
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(3 * time.Second):
		}
		os.Exit(130)
	}()
	return ctx
}

// options are the command's settings, from flags and the environment.
type options struct {
	command string // demo, serve or produce

	broker       string   // kafka or amqp
	kafkaBrokers []string // KAFKA_BROKERS; empty: embedded
	amqpURL      string   // AMQP_URL
	databaseURL  string   // DATABASE_URL; empty: throwaway
	schema       string

	topic        string // Kafka topic, or AMQP queue
	name         string // consumer name and Kafka group
	partitions   int
	kafkaPort    int
	fastFailover bool
	offsetsInDB  bool // kafka: kafka.Config.OffsetsInDatabase

	mix              Mix
	unknownOrderWait time.Duration
	maxAttempts      int
	crash            bool
	shipping         bool // serve: run the outbox relay and the shipping consumer too (shipping.go)

	metricsAddr string
	httpAddr    string // serve: the HTTP API (http.go)
	traces      string
	verbose     bool
	label       string
}

// parseOptions reads args (without the program name) and the environment.
func parseOptions(args []string, stderr io.Writer) (*options, error) {
	o := &options{command: "demo"}
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		o.command, args = args[0], args[1:]
	}
	switch o.command {
	case "demo", "serve", "produce":
	default:
		return nil, fmt.Errorf("unknown command %q: want demo, serve or produce", o.command)
	}
	fs := flag.NewFlagSet("order-processor "+o.command, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.broker, "broker", envOr("BROKER", "kafka"), "message broker: kafka or amqp (env BROKER)")
	fs.StringVar(&o.topic, "topic", "orders", "Kafka topic or RabbitMQ queue; its dead-letter queue is <topic>.dlq")
	fs.StringVar(&o.name, "name", "order-processor", "consumer name: the dedup scope and the Kafka consumer group")
	fs.IntVar(&o.partitions, "partitions", 4, "partitions of the topic when this program creates it")
	fs.IntVar(&o.kafkaPort, "kafka-port", 0, "port of the embedded Kafka broker (0: a free one)")
	fs.BoolVar(&o.fastFailover, "fast-failover", false, "short consumer-group timeouts (set automatically with the embedded broker)")
	fs.BoolVar(&o.offsetsInDB, "offsets-in-database", false, "kafka: keep the group's offsets in PostgreSQL with the effects (kafka.Config.OffsetsInDatabase)")
	defSchema := "public"
	if o.command == "demo" {
		defSchema = "order_demo"
	}
	fs.StringVar(&o.schema, "schema", defSchema, "PostgreSQL schema of the tables (the demo empties its tables there first)")
	fs.IntVar(&o.mix.Orders, "orders", 3000, "orders to generate (demo, produce)")
	fs.Float64Var(&o.mix.Duplicates, "dup", 0.05, "share of events published twice with the same id")
	fs.Float64Var(&o.mix.IDless, "idless", 0.03, "share of events published without an id, twice")
	fs.Float64Var(&o.mix.Malformed, "malformed", 0.005, "malformed messages per order")
	fs.Float64Var(&o.mix.Violations, "violations", 0.01, "rule-violating events per order")
	fs.Int64Var(&o.mix.Seed, "seed", 0, "traffic seed (0: from the clock)")
	fs.DurationVar(&o.unknownOrderWait, "unknown-order-wait", 100*time.Millisecond, "retry delay for an event whose order does not exist yet (amqp: 250ms)")
	fs.IntVar(&o.maxAttempts, "max-attempts", 4, "handler attempts before an event is dead-lettered (amqp: 8)")
	fs.BoolVar(&o.crash, "crash", true, "demo: kill (SIGKILL) a first consumer process mid-stream, then resume")
	fs.BoolVar(&o.shipping, "shipping", true, "serve: also run the second hop: the outbox relay (order.confirmed) and the shipping consumer")
	fs.StringVar(&o.metricsAddr, "metrics-addr", envOr("METRICS_ADDR", "127.0.0.1:0"), `address of /metrics and /healthz ("" or "off": none)`)
	fs.StringVar(&o.httpAddr, "http-addr", "", `serve: address of the HTTP API, POST /orders with an Idempotency-Key ("": none)`)
	fs.StringVar(&o.traces, "traces", "", `export spans: "stdout" or a file name ("": off)`)
	fs.StringVar(&o.label, "label", "", "prefix of the progress line")
	fs.BoolVar(&o.verbose, "v", false, "log the consumer's warnings (dead letters, retries)")
	fs.Usage = func() {
		fmt.Fprint(stderr, `Usage:
  order-processor [demo] [flags]   generate traffic, consume it with a crash in the middle, print a verdict
  order-processor serve [flags]    consume until SIGINT/SIGTERM (a second signal exits at once)
  order-processor produce [flags]  publish generated traffic to a running broker

Environment: BROKER (kafka or amqp), KAFKA_BROKERS (host:port,...), AMQP_URL,
DATABASE_URL, METRICS_ADDR. Without KAFKA_BROKERS an embedded Kafka broker is
started; without DATABASE_URL a throwaway PostgreSQL server.

Flags of `+o.command+`:
`)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if o.metricsAddr == "off" {
		o.metricsAddr = ""
	}
	if o.mix.Seed == 0 {
		o.mix.Seed = time.Now().UnixNano()%900000 + 100000
	}
	if b := os.Getenv("KAFKA_BROKERS"); b != "" {
		o.kafkaBrokers = strings.Split(b, ",")
	}
	o.amqpURL = os.Getenv("AMQP_URL")
	o.databaseURL = os.Getenv("DATABASE_URL")
	switch o.broker {
	case "kafka":
	case "amqp", "rabbitmq":
		o.broker = "amqp"
		o.mix.Unordered = true
		// Without order, a payment can overtake its order.created, by a
		// whole queue after a crash (redeliveries come back out of place):
		// give it longer to arrive.
		if !set["unknown-order-wait"] {
			o.unknownOrderWait = 250 * time.Millisecond
		}
		if !set["max-attempts"] {
			o.maxAttempts = 8
		}
	default:
		return nil, fmt.Errorf("-broker %q: want kafka or amqp", o.broker)
	}
	if o.command == "produce" && o.broker == "kafka" && len(o.kafkaBrokers) == 0 {
		return nil, errors.New("produce needs KAFKA_BROKERS (e.g. the address serve printed)")
	}
	if o.broker == "amqp" && o.amqpURL == "" {
		return nil, errors.New("-broker amqp needs AMQP_URL")
	}
	return o, nil
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

// realMain runs one command and returns the process's exit code: 0, 1 for
// an error or a failed verdict, 2 for bad usage.
func realMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "chaos" {
		return chaosMain(ctx, args[1:], stdout, stderr) // flags of its own (chaos.go)
	}
	o, err := parseOptions(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "order-processor:", err)
		return 2
	}
	switch o.command {
	case "serve":
		err = serve(ctx, o, stdout, stderr)
	case "produce":
		err = produce(ctx, o, stdout)
	default:
		err = demo(ctx, o, stdout, stderr)
	}
	if err != nil {
		fmt.Fprintln(stderr, "order-processor:", err)
		return 1
	}
	return 0
}

// infra is what a run needs: a database and a broker, real or embedded.
type infra struct {
	dbURL   string
	closers []func()
}

// startInfra connects to the servers in o, or starts embedded ones, and
// prints where they are.
func startInfra(ctx context.Context, o *options, out io.Writer) (*infra, error) {
	inf := &infra{dbURL: o.databaseURL}
	if inf.dbURL == "" {
		srv, err := pgtemp.Start(ctx, pgtemp.Options{Durable: true})
		if err != nil {
			return nil, err
		}
		atForcedExit(func() { _ = srv.Close() })
		inf.closers = append(inf.closers, func() { _ = srv.Close() })
		inf.dbURL = srv.URL()
		fmt.Fprintf(out, "PostgreSQL: a throwaway server on 127.0.0.1:%d, removed on exit (set DATABASE_URL to use yours)\n", srv.Port())
	}
	switch o.broker {
	case "kafka":
		if len(o.kafkaBrokers) > 0 {
			if err := createKafkaTopics(o.kafkaBrokers, o.topic, int32(o.partitions)); err != nil {
				// Topic creation may be reserved to administrators: go on,
				// the topics may exist.
				fmt.Fprintf(out, "Kafka: could not create the topics (%v); they must exist\n", err)
			}
			fmt.Fprintf(out, "Kafka: %s, topic %s (dead letters: %s.dlq)\n", strings.Join(o.kafkaBrokers, ","), o.topic, o.topic)
			break
		}
		k, err := startEmbeddedKafka(o.kafkaPort, o.topic, int32(o.partitions))
		if err != nil {
			inf.Close()
			return nil, err
		}
		inf.closers = append(inf.closers, k.Close)
		o.kafkaBrokers = k.addrs
		o.fastFailover = true
		fmt.Fprintf(out, "Kafka: an embedded Kafka-protocol broker (kfake) listening on %s, topics %s and %s (and their .dlq; %d partitions)\n",
			k.addrs[0], o.topic, confirmedName(o), o.partitions)
		fmt.Fprintf(out, "       produce to it with: kcat -b %s -t %s -P -k o-1 -H id=evt-1 -H type=%s\n", k.addrs[0], o.topic, TypeCreated)
	case "amqp":
		// The source declares the queue and its dead-letter queue when it
		// opens; the demo and produce declare them before publishing.
		fmt.Fprintf(out, "RabbitMQ: queue %s (dead letters: %s.dlq)\n", o.topic, o.topic)
	}
	return inf, nil
}

// Close stops what startInfra started, in reverse order.
func (inf *infra) Close() {
	for i := len(inf.closers) - 1; i >= 0; i-- {
		inf.closers[i]()
	}
}

// databaseWait paces openDatabase's attempts while the database cannot be
// reached.
var databaseWait = backoff.Policy{Initial: 100 * time.Millisecond, Max: 2 * time.Second}

// openDatabase opens the pool and creates the tables of the orders (Migrate).
// While the database cannot be reached (restarting, failing over, not up
// yet: a failure consumer.IsTransient accepts) it says so on stderr and
// tries again until ctx ends, as the consumer's own start does: a service
// started during a database restart waits for it rather than exit. Any
// other failure (a wrong password, a permission refused) is returned at
// once.
func openDatabase(ctx context.Context, url, schema string, stderr io.Writer) (*pgxpool.Pool, error) {
	wait := backoff.Retrier{Policy: databaseWait}
	for {
		pool, err := openPool(ctx, url, schema)
		if err == nil {
			if err = Migrate(ctx, pool); err == nil {
				return pool, nil
			}
			pool.Close()
		}
		if ctx.Err() != nil || !consumer.IsTransient(err) {
			return nil, err
		}
		d := wait.Delay()
		fmt.Fprintf(stderr, "order-processor: waiting for the database (attempt %d failed: %v); next attempt in %v\n",
			wait.Failures(), err, d.Round(time.Millisecond))
		if !backoff.Sleep(ctx, d) {
			return nil, fmt.Errorf("stopped while waiting for the database: %w", err)
		}
	}
}

// openPool connects to the database with search_path set to schema, which
// it creates if needed.
func openPool(ctx context.Context, url, schema string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	if schema != "" {
		conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig.Copy())
		if err != nil {
			return nil, err
		}
		_, err = conn.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+pgx.Identifier{schema}.Sanitize())
		conn.Close(ctx)
		if err != nil {
			return nil, err
		}
		// Quoted, as CREATE SCHEMA took it: unquoted, the search_path
		// would fold an upper-case name to lower case.
		cfg.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{schema}.Sanitize()
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}

// logger is the consumer's logger: warnings to stderr with -v, errors only
// otherwise (the demo's poison is expected and counted in the report).
func logger(o *options, stderr io.Writer) *slog.Logger {
	level := slog.LevelError
	if o.verbose {
		level = slog.LevelWarn
	}
	return slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
}

// newSource opens the source of o.broker.
func newSource(ctx context.Context, o *options, tel *telemetry, log *slog.Logger) (consumer.Source, error) {
	if o.broker == "amqp" {
		return amqpSource(ctx, o, tel, log)
	}
	return kafkaSource(ctx, o, tel.MeterProvider(), log)
}

// newConsumer builds the service's consumer: the router of typed handlers,
// the payload-derived event-id rule, the retry policy.
func newConsumer(pool *pgxpool.Pool, src consumer.Source, o *options, tel *telemetry, log *slog.Logger) (*consumer.Consumer[OrderEvent], error) {
	orders := &Orders{UnknownOrderWait: o.unknownOrderWait, Confirmed: destination(o)}
	r, err := orders.Router()
	if err != nil {
		return nil, err
	}
	return consumer.NewRouted(pool, src, r, consumer.Config{
		Name:     o.name,
		Identify: consumer.IdentifyConfig{EventID: EventID, Fingerprint: Fingerprint, IDHeaders: IDHeaders, TypeHeaders: TypeHeaders},
		Envelope: CloudEventsEnvelope{},

		Retry: consumer.RetryPolicy{
			MaxAttempts:    o.maxAttempts,
			InitialBackoff: 50 * time.Millisecond,
			MaxBackoff:     time.Second,
		},
		ShutdownTimeout: 10 * time.Second,
		Telemetry:       consumer.TelemetryConfig{Logger: log, TracerProvider: tel.tracer, MeterProvider: tel.MeterProvider()},
	})
}

// serve consumes until ctx is cancelled (SIGINT, SIGTERM).
func serve(ctx context.Context, o *options, stdout, stderr io.Writer) error {
	inf, err := startInfra(ctx, o, stdout)
	if err != nil {
		return err
	}
	defer inf.Close()
	pool, err := openDatabase(ctx, inf.dbURL, o.schema, stderr)
	if err != nil {
		return err
	}
	defer pool.Close()
	tel, err := startTelemetry(o.metricsAddr, o.traces)
	if err != nil {
		return err
	}
	defer tel.Close()
	if tel.addr != "" {
		fmt.Fprintf(stdout, "metrics: http://%s/metrics  health: http://%s/healthz\n", tel.addr, tel.addr)
	}
	log := logger(o, stderr)
	if err := startWeb(ctx, o, pool, log, stdout); err != nil {
		return err
	}
	src, err := newSource(ctx, o, tel, log)
	if err != nil {
		return err
	}
	c, err := newConsumer(pool, src, o, tel, log)
	if err != nil {
		_ = src.Close()
		return err
	}
	var down *downstream
	if o.shipping {
		if down, err = newDownstream(ctx, o, pool, tel, log); err != nil {
			_ = src.Close()
			return err
		}
	}
	fmt.Fprintf(stdout, "consuming %s as %q; Ctrl-C drains and stops\n", o.topic, o.name)
	if down != nil {
		fmt.Fprintf(stdout, "second hop: an outbox relay publishing %s, and %q consuming it\n", confirmedName(o), shippingName(o))
	}
	tel.pool.Store(pool)
	tel.running.Store(true)
	p := startProgress(stderr, o.label, c.Stats)
	// The consumer and the second hop stop together: when one of them
	// ends by itself (a failed migration, a fatal source error), the others
	// drain and stop too, and serve returns its error, rather than run on
	// without it.
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	downErr := make(chan error, 1)
	if down != nil {
		go func() { defer stop(); downErr <- down.Run(runCtx) }()
	} else {
		downErr <- nil
	}
	err = c.Run(runCtx)
	stop()
	err = errors.Join(err, <-downErr)
	tel.running.Store(false)
	p.Stop()
	s := c.Stats()
	fmt.Fprintf(stdout, "stopped: received %d, handled %d, duplicates skipped %d, dead-lettered %d\n",
		s.Received, s.Handled, s.Duplicates, s.DeadLettered)
	if down != nil {
		s := down.shipping.Stats()
		fmt.Fprintf(stdout, "shipping stopped: received %d, handled %d, duplicates skipped %d, dead-lettered %d\n",
			s.Received, s.Handled, s.Duplicates, s.DeadLettered)
	}
	if err != nil && onlyCloseTimeouts(err) {
		// Everything was handled or left unacked; the Kafka clients took
		// longer than CloseTimeout to commit and leave the group (a
		// rebalance in progress). The records of offsets not committed
		// are delivered again and skipped as duplicates: a clean stop.
		fmt.Fprintln(stderr, "order-processor: stopped; note:", err)
		return nil
	}
	return err
}

// onlyCloseTimeouts reports whether every error that err joins or wraps
// ends in kafka.ErrCloseTimeout, which loses nothing.
func onlyCloseTimeouts(err error) bool {
	if err == kafka.ErrCloseTimeout { //nolint:errorlint // the walk below unwraps each error itself
		return true
	}
	switch e := err.(type) { //nolint:errorlint // each joined or wrapped error is looked at, not the first match
	case interface{ Unwrap() []error }:
		n := 0
		for _, inner := range e.Unwrap() {
			if inner == nil {
				continue
			}
			if !onlyCloseTimeouts(inner) {
				return false
			}
			n++
		}
		return n > 0
	case interface{ Unwrap() error }:
		return onlyCloseTimeouts(e.Unwrap())
	}
	return false
}

// publisher publishes generated traffic to the broker.
type publisher interface {
	Publish(ctx context.Context, msgs []outMsg) error
	Close() error
}

func newPublisher(ctx context.Context, o *options) (publisher, error) {
	if o.broker == "amqp" {
		return newAMQPPublisher(ctx, o)
	}
	return newKafkaPublisher(o.kafkaBrokers, o.topic)
}

// produce publishes generated traffic to a running broker.
func produce(ctx context.Context, o *options, stdout io.Writer) error {
	if o.broker == "kafka" {
		if err := createKafkaTopics(o.kafkaBrokers, o.topic, int32(o.partitions)); err != nil {
			return err
		}
	} else if err := prepareAMQP(ctx, o); err != nil {
		return err
	}
	plan := Generate(o.mix)
	pub, err := newPublisher(ctx, o)
	if err != nil {
		return err
	}
	defer pub.Close()
	start := time.Now()
	if err := pub.Publish(ctx, plan.Messages); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "published %d messages to %s in %s (seed %d): %s\n", len(plan.Messages), o.topic,
		time.Since(start).Round(time.Millisecond), o.mix.Seed, plan.sentSummary())
	fmt.Fprintf(stdout, "expected: %d orders, %d payments summing to %d cents, %d dead letters (%d decode, %d handler)\n",
		len(plan.Orders), plan.LedgerRows, plan.LedgerSum, plan.Malformed+plan.Violations, plan.Malformed, plan.Violations)
	return nil
}
