// Command oncebench is `make bench`: the side-by-side benchmark of package
// internal/bench. One run, the same workload for every row: the source
// ceiling, the database ceiling (pgbench), the naive consumer and the
// library per message, batched, and with a BatchHandler, for Kafka (kfake in
// this process, over TCP) and RabbitMQ (AMQP_URL). It prints a Markdown
// table and the targets, and exits non-zero when a row's effects are wrong
// or a row failed (the table then marks it FAILED, with its error).
//
//	go run ./internal/bench/cmd/oncebench [-n 20000] [-json FILE] [-rss-check]
//
// PostgreSQL is DATABASE_URL, or a durable throwaway server (fsync on).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"time"

	"github.com/onceco/once/internal/bench"
)

func main() {
	bench.RunChildIfRequested()
	os.Exit(run())
}

func run() int {
	var (
		events     = flag.Int("n", 20000, "distinct events per row")
		dup        = flag.Int("dup-every", 10, "every Nth event is published twice")
		poison     = flag.Int("poison-every", 1000, "every Nth event is poison")
		partitions = flag.Int("partitions", 4, "Kafka partitions (and naive workers)")
		batch      = flag.Int("batch", 100, "BatchSize of the batched rows and of the pgbench script")
		brokers    = flag.String("brokers", "kafka,apache-kafka,rabbitmq", "brokers to benchmark: kafka (kfake in process), apache-kafka (a throwaway Apache Kafka node; scripts/kafka.sh fetch), rabbitmq (needs AMQP_URL)")
		rows       = flag.String("rows", "", "consumer rows to run, comma-separated (default all; none: no consumer row): "+rowNames())
		paceFor    = flag.Duration("pace", 3*time.Second, "length of each row's paced latency phase (0: none)")
		paceMax    = flag.Float64("pace-max", 50000, "cap on the paced rate, msgs/s")
		runs       = flag.Int("runs", 1, "runs of each broker's consumer rows in the table, one after the other; the targets then state every run's value (ONCE_BENCH_PROFILE names files <broker>-<row>-run<N>); -rss-check, -scale and -scale-out run once")
		conc       = flag.Int("concurrency", 0, "consumer.Config.Concurrency of the once rows (0: the library's default)")
		keyLanes   = flag.Int("key-lanes", 4, "kafka.Config.KeyLanes of the once-key-lanes row")
		ordered    = flag.Bool("amqp-ordered", false, "RabbitMQ once rows: one ordered stream (amqp.Config.Ordered)")
		lazy       = flag.Bool("amqp-lazy", false, "RabbitMQ rows: queues declared with x-queue-mode lazy (RabbitMQ before 3.12: the backlog on disk, not paged by the queue process)")
		pgNoFsync  = flag.Bool("pg-no-fsync", false, "diagnostic: the throwaway PostgreSQL with fsync and synchronous_commit off (the tail without the disk's stalls); no target is judged, and the library's guarantees need fsync on")
		kafkaDir   = flag.String("kafka-dir", "", "directory for the throwaway Apache Kafka node's files (default the system's temporary directory; make bench: BENCH_BROKER_DIR, off the database's disk)")
		pgbenchFor = flag.Duration("pgbench", 5*time.Second, "length of the pgbench ceiling (0: none)")
		httpN      = flag.Int("http", 20000, "requests of each HTTP row, plain and behind the idempotency middleware (0: none)")
		outboxN    = flag.Int("outbox", 200000, "rows of each broker's outbox rows: relay next to the confirmed-publish ceiling, then latency (0: none)")
		rowTimeout = flag.Duration("row-timeout", 0, "deadline of each row's subprocess, after which it is killed and the row reported FAILED (0: 3 x (1m + 1ms a message) + -pace + 1m)")
		jsonOut    = flag.String("json", "", "also write the report as JSON to this file")
		rssCheck   = flag.Bool("rss-check", false, "instead of the table: peak RSS of the Kafka batched row at each of -rss-sizes events")
		rssSizes   = flag.String("rss-sizes", "100000,1000000", "event counts of -rss-check")
		scale      = flag.Bool("scale", false, "instead of the table: the batched rows as processed_events grows to -scale-rows, then retention while consuming (make bench-scale)")
		scaleRows  = flag.Int64("scale-rows", 10_000_000, "-scale: rows to fill processed_events with")
		scaleSteps = flag.String("scale-steps", "0,0.1,0.3,1", "-scale: table sizes measured, as fractions of -scale-rows")
		scaleN     = flag.Int("scale-n", 50000, "-scale: distinct events of each measured run")
		retN       = flag.Int("scale-retention-n", 200000, "-scale: distinct events of the retention phase's runs")
		retBatch   = flag.Int("scale-retention-batch", 5000, "-scale: batch size of dedup.Store.DeleteOlderThan")
		retDuty    = flag.Float64("scale-retention-duty", 0.1, "-scale: dedup.DutyCycle of the retention sweep (the consumer's default 0.1; 1: full speed)")
		pngOut     = flag.String("png", "", "-scale: also plot msgs/s against table size to this PNG file")
		scaleOut   = flag.String("scale-out", "", "instead of the table: each row (default once-batch-handler) run by each of these numbers of processes of one consumer name at once, e.g. 1,2,4")
	)
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	o := bench.Options{
		Workload:    bench.Workload{Events: *events, DupEvery: *dup, PoisonEvery: *poison, Partitions: *partitions},
		PGBench:     *pgbenchFor,
		BatchSize:   *batch,
		Concurrency: *conc,
		AMQPOrdered: *ordered,
		AMQPLazy:    *lazy,
		PGNoFsync:   *pgNoFsync,
		KafkaDir:    *kafkaDir,
		KeyLanes:    *keyLanes,
		Pace:        *paceFor,
		PaceMax:     *paceMax,
		Runs:        *runs,
		RowTimeout:  *rowTimeout,
		DatabaseURL: os.Getenv("DATABASE_URL"),
		AMQPURL:     os.Getenv("AMQP_URL"),
		Log:         os.Stderr,
	}
	for _, b := range strings.Split(*brokers, ",") {
		switch b := bench.Broker(strings.TrimSpace(b)); b {
		case bench.Kafka, bench.ApacheKafka:
			o.Brokers = append(o.Brokers, b)
		case bench.RabbitMQ:
			if o.AMQPURL == "" && !*rssCheck {
				fmt.Fprintln(os.Stderr, "oncebench: AMQP_URL is unset: skipping RabbitMQ (make bench starts a node)")
				continue
			}
			if o.AMQPURL != "" {
				o.Brokers = append(o.Brokers, b)
			}
		default:
			fmt.Fprintf(os.Stderr, "oncebench: unknown broker %q\n", b)
			return 2
		}
	}
	switch *rows {
	case "":
		o.Rows = bench.AllRows
	case "none": // e.g. the outbox rows alone
	default:
		for _, r := range strings.Split(*rows, ",") {
			row, ok := parseRow(strings.TrimSpace(r))
			if !ok {
				fmt.Fprintf(os.Stderr, "oncebench: unknown row %q (rows: %s)\n", r, rowNames())
				return 2
			}
			o.Rows = append(o.Rows, row)
		}
	}
	if *rssCheck {
		return runRSSCheck(ctx, o, *rssSizes)
	}
	if *scaleOut != "" {
		if *rows == "" {
			o.Rows = []bench.Row{bench.RowOnceBatchHandler}
		}
		return runScaleOut(ctx, o, *scaleOut, *jsonOut)
	}
	if *scale {
		if *pgNoFsync {
			fmt.Fprintln(os.Stderr, "oncebench: -pg-no-fsync does not apply to -scale, whose figures are of a durable server")
			return 2
		}
		so := bench.ScaleOptions{TableRows: *scaleRows, RetentionEvents: *retN, RetentionBatch: *retBatch, RetentionDuty: *retDuty, BatchSize: *batch,
			Workload:    bench.Workload{Events: *scaleN, DupEvery: *dup, PoisonEvery: *poison, Partitions: *partitions},
			DatabaseURL: o.DatabaseURL, Log: os.Stderr}
		if *rows != "" {
			so.Rows = o.Rows
		}
		for _, s := range strings.Split(*scaleSteps, ",") {
			f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
			if err != nil || f < 0 || f > 1 {
				fmt.Fprintf(os.Stderr, "oncebench: bad step %q\n", s)
				return 2
			}
			so.Steps = append(so.Steps, f)
		}
		return runScale(ctx, so, *jsonOut, *pngOut)
	}
	o.HTTPRequests = *httpN
	o.OutboxRows = *outboxN

	rep, err := bench.Run(ctx, o)
	if rep == nil {
		fmt.Fprintln(os.Stderr, "oncebench:", err)
		return 1
	}
	// Interrupted, Run still reports the rows that ran.
	if err := rep.WriteTable(os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "oncebench:", err)
		return 1
	}
	if *jsonOut != "" {
		if err := rep.WriteJSON(*jsonOut); err != nil {
			fmt.Fprintln(os.Stderr, "oncebench:", err)
			return 1
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "oncebench:", err)
		return 1
	}
	// A failed row is not Correct either.
	for _, r := range rep.Results {
		if !r.Correct {
			return 1
		}
	}
	if !rep.HTTP.Correct() {
		return 1
	}
	for _, r := range rep.Outbox {
		if !r.Correct {
			return 1
		}
	}
	return 0
}

// runRSSCheck runs the Kafka batched row at each size, without the paced
// phase and pgbench, and compares the peak RSS of its subprocess.
func runRSSCheck(ctx context.Context, o bench.Options, sizes string) int {
	o.Brokers, o.Rows, o.PGBench, o.Pace, o.Runs = []bench.Broker{bench.Kafka}, []bench.Row{bench.RowOnceBatched}, 0, 0, 1
	var first float64
	ok := true
	for _, s := range strings.Split(sizes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n <= 0 {
			fmt.Fprintf(os.Stderr, "oncebench: bad size %q\n", s)
			return 2
		}
		o.Workload.Events = n
		rep, err := bench.Run(ctx, o)
		if err != nil {
			fmt.Fprintln(os.Stderr, "oncebench:", err)
			return 1
		}
		r := rep.Results[0]
		if r.Error != "" {
			fmt.Printf("kafka once batched, %8d events: FAILED (%s)\n", n, r.Error)
			return 1
		}
		if first == 0 {
			first = r.PeakRSSMB
		}
		growth := r.PeakRSSMB/first - 1
		fmt.Printf("kafka once batched, %8d events (%8d msgs): %8.0f msgs/s, peak RSS %6.1f MB (%+.1f%% vs the first size; Go heap obtained %.1f MB, in use %.1f MB), %.1f allocs/msg, correct: %v (%s)\n",
			n, r.Messages, r.Rate, r.PeakRSSMB, 100*growth, r.HeapSysMB, r.HeapInuseMB, r.AllocsPerMsg, r.Correct, r.Check)
		ok = ok && r.Correct && growth <= 0.10
	}
	if !ok {
		fmt.Println("peak RSS flat within 10%: NOT met (or a row's effects were wrong)")
		return 1
	}
	fmt.Println("peak RSS flat within 10%: met")
	return 0
}

// runScale runs bench-scale and writes its table, JSON and plot.
func runScale(ctx context.Context, so bench.ScaleOptions, jsonOut, pngOut string) int {
	rep, err := bench.RunScale(ctx, so)
	if err != nil {
		fmt.Fprintln(os.Stderr, "oncebench:", err)
		return 1
	}
	if err := rep.WriteTable(os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "oncebench:", err)
		return 1
	}
	if jsonOut != "" {
		if err := rep.WriteJSON(jsonOut); err != nil {
			fmt.Fprintln(os.Stderr, "oncebench:", err)
			return 1
		}
	}
	if pngOut != "" {
		if err := rep.WritePNG(pngOut); err != nil {
			fmt.Fprintln(os.Stderr, "oncebench:", err)
			return 1
		}
	}
	if !rep.Correct() {
		return 1
	}
	return 0
}

func parseRow(s string) (bench.Row, bool) {
	for _, r := range bench.AllRows {
		if s == string(r) || s == strings.ReplaceAll(string(r), " ", "-") {
			return r, true
		}
	}
	return "", false
}

func rowNames() string {
	var out []string
	for _, r := range bench.AllRows {
		out = append(out, strings.ReplaceAll(string(r), " ", "-"))
	}
	return strings.Join(out, ",")
}

// runScaleOut runs the rows with each number of processes and prints the
// rate and each process's share side by side.
func runScaleOut(ctx context.Context, o bench.Options, counts, jsonOut string) int {
	// One run per process count: -runs is the table's (make bench passes it).
	o.PGBench, o.Pace, o.HTTPRequests, o.Runs = 0, 0, 0, 1
	var reports []*bench.Report
	var procs []int
	ok := true
	for _, s := range strings.Split(counts, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n <= 0 {
			fmt.Fprintf(os.Stderr, "oncebench: bad process count %q\n", s)
			return 2
		}
		o.Processes = n
		rep, err := bench.Run(ctx, o)
		if err != nil {
			fmt.Fprintln(os.Stderr, "oncebench:", err)
			return 1
		}
		reports, procs = append(reports, rep), append(procs, n)
	}
	fmt.Printf("%-9s %-20s %9s %10s %10s %8s  %-28s %s\n", "broker", "row", "processes", "msgs/s", "x one", "msgs/tx", "share of each process", "correct")
	base := map[string]float64{}
	for i, rep := range reports {
		for _, r := range rep.Results {
			key := string(r.Broker) + "/" + string(r.Row)
			if i == 0 {
				base[key] = r.Rate
			}
			shares := make([]string, 0, len(r.Shares))
			for _, sh := range r.Shares {
				shares = append(shares, fmt.Sprintf("%.0f%%", 100*float64(sh)/float64(r.Messages)))
			}
			if len(shares) == 0 {
				shares = append(shares, "100%")
			}
			if r.Error != "" {
				fmt.Printf("%-9s %-20s %9d FAILED (%s)\n", r.Broker, r.Row, procs[i], r.Error)
				ok = false
				continue
			}
			fmt.Printf("%-9s %-20s %9d %10.0f %10.2f %8.1f  %-28s %v (%s)\n", r.Broker, r.Row, max(1, r.Processes), r.Rate,
				r.Rate/base[key], r.MsgsPerTx, strings.Join(shares, " "), r.Correct, r.Check)
			ok = ok && r.Correct
		}
	}
	if jsonOut != "" {
		raw, err := json.MarshalIndent(reports, "", "  ")
		if err == nil {
			err = os.WriteFile(jsonOut, append(raw, '\n'), 0o644)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "oncebench:", err)
			return 1
		}
	}
	if !ok {
		return 1
	}
	return 0
}
