// Package bench is the side-by-side benchmark behind `make bench`: the same
// workload (distinct events, 10% of them published twice, 0.1% poison,
// ~200-byte payloads, 4 partitions) consumed by several rows, for Kafka
// (kfake in this process, spoken to over TCP by sarama) and RabbitMQ:
//
//   - the ceilings: the adapter's Source alone (receive and ack, no
//     database), and the database alone (pgbench running the claim and the
//     business insert at the same batch size);
//   - naive: one transaction per message, SELECT the id, INSERT it and the
//     business row, commit, ack;
//   - once: the library per message (BatchSize 1), batched (BatchSize 100),
//     and batched with a BatchHandler writing the batch with one statement.
//
// Each consumer row runs in a subprocess of the same executable (see
// RunChildIfRequested), so that its peak RSS and its allocations are its
// own. The parent hosts the Kafka cluster, publishes each row's backlog,
// starts the row, and afterwards checks its effects: one business row per
// valid event, no more; every poison message in the dead-letter queue; every
// message acked.
package bench

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtemp"
	"github.com/onceco/once/outbox"
)

// Broker names a message broker.
type Broker string

// The brokers benchmarked.
const (
	// Kafka is kfake, the in-process implementation of the protocol.
	Kafka Broker = "kafka"
	// ApacheKafka is Apache Kafka itself: a throwaway single-node KRaft
	// cluster in its own JVM (internal/kafkatemp), same workload.
	ApacheKafka Broker = "apache-kafka"
	RabbitMQ    Broker = "rabbitmq"
)

// IsKafka reports whether b speaks the Kafka protocol (kfake or Apache
// Kafka): the Kafka adapter and the Kafka rows apply to it.
func (b Broker) IsKafka() bool { return b == Kafka || b == ApacheKafka }

// Row names one way of consuming the workload.
type Row string

// The rows, in the order they run.
const (
	// RowCeiling receives and acks through the adapter's Source, with no
	// database.
	RowCeiling Row = "ceiling"
	// RowNaive is one transaction per message: SELECT, INSERT, commit, ack.
	RowNaive Row = "naive"
	// RowHandwritten is the batched consumer a careful engineer writes
	// without the library: batches of up to 100 or 5 ms, one unnest claim,
	// one multi-row business insert, one commit, then acks.
	RowHandwritten Row = "hand-written batched"
	// RowOncePerMessage is the library with BatchSize 1.
	RowOncePerMessage Row = "once per message"
	// RowOnceBatched is the library with BatchSize 100 and a per-event
	// handler.
	RowOnceBatched Row = "once batched"
	// RowOnceQueued is RowOnceBatched with the handler's insert queued
	// (Event.Queue), so a batch's inserts share one round trip.
	RowOnceQueued Row = "once queued"
	// RowOnceBatchHandler is the library with BatchSize 100 and a
	// BatchHandler writing the batch with one multi-row INSERT.
	RowOnceBatchHandler Row = "once batch handler"
	// RowOnceKeyLanes is RowOnceBatched with each Kafka partition split
	// into Options.KeyLanes streams by record key (kafka.Config.KeyLanes).
	// Kafka only.
	RowOnceKeyLanes Row = "once key lanes"
)

// AllRows lists every consumer row.
var AllRows = []Row{RowCeiling, RowNaive, RowHandwritten, RowOncePerMessage, RowOnceBatched, RowOnceQueued, RowOnceBatchHandler, RowOnceKeyLanes}

// ForBroker reports whether the row applies to b.
func (r Row) ForBroker(b Broker) bool { return r != RowOnceKeyLanes || b.IsKafka() }

// Options configure a run.
type Options struct {
	// Workload is what every row consumes (Events per row).
	Workload Workload
	// Brokers to benchmark. Kafka needs nothing; RabbitMQ needs AMQPURL.
	Brokers []Broker
	// Rows to run for each broker.
	Rows []Row
	// PGBench runs the database ceiling for this long; 0 skips it.
	PGBench time.Duration
	// BatchSize of the batched rows and of the pgbench script.
	BatchSize int
	// Concurrency is consumer.Config.Concurrency of the library's rows; 0
	// keeps the library's default, the pool's MaxConns (8 in the rows).
	Concurrency int
	// KeyLanes is kafka.Config.KeyLanes of RowOnceKeyLanes. Defaults to 4.
	KeyLanes int
	// AMQPOrdered sets the RabbitMQ source's Ordered option for the
	// library's rows: the queue becomes one stream, handled in order in
	// batches.
	AMQPOrdered bool
	// AMQPLazy declares the RabbitMQ rows' queues with x-queue-mode lazy:
	// the backlog on disk instead of in the queue process's memory, whose
	// paging pauses a default classic queue of RabbitMQ before 3.12 (later
	// versions ignore the mode and keep classic queues so by default).
	AMQPLazy bool
	// PGNoFsync runs the throwaway PostgreSQL with fsync and
	// synchronous_commit off: a diagnostic of what the tail is when no
	// commit waits for the disk. The library's guarantees do not hold on
	// such a server, and the report judges no target. It needs the
	// throwaway server (DatabaseURL empty).
	PGNoFsync bool
	// KafkaDir is where the throwaway Apache Kafka node keeps its files
	// (kafkatemp.Options.Dir); empty: the system's temporary directory.
	// make bench gives it a memory-backed directory so that the broker's
	// log does not share the disk, and its stalls, with PostgreSQL's WAL,
	// as on separate hosts.
	KafkaDir string
	// NaiveWorkers is the naive row's concurrency: one worker per
	// partition for Kafka, shared workers for RabbitMQ.
	NaiveWorkers int
	// Pace is the length of each row's paced phase, in which fresh events
	// are produced at half the row's measured rate and their
	// produce-to-ack latency recorded; 0 skips it.
	Pace time.Duration
	// PaceMax caps the paced rate (msgs/s).
	PaceMax float64
	// Runs is how many times each broker's consumer rows run, one run of
	// every row after the other, so that the targets can be stated over
	// runs in a row and a ratio's spread is seen (Result.Run). The
	// outbox and HTTP rows run once. 0 or 1: one run.
	Runs int
	// DatabaseURL is the PostgreSQL server; empty starts a durable
	// throwaway one (fsync on).
	DatabaseURL string
	// AMQPURL is the RabbitMQ node.
	AMQPURL string
	// Processes > 1 runs each row in that many processes of one consumer
	// name at once, in one Kafka group or on one RabbitMQ queue, sharing
	// the backlog (scaleout.go); no paced phase then. 0 or 1: one.
	Processes int
	// HTTPRequests is the number of requests of each HTTP row (http.go);
	// 0 skips them.
	HTTPRequests int
	// OutboxRows is the number of rows of each broker's outbox rows
	// (outbox.go): relay and confirmed-publish ceiling; 0 skips them.
	OutboxRows int
	// RowTimeout is how long a row's subprocess may run before it is
	// killed and the row reported failed (Result.Error); 0: three times
	// the time each of its phases may take (a minute and a millisecond a
	// message), its paced phase and a minute.
	RowTimeout time.Duration
	// Log receives progress lines; nil discards them.
	Log io.Writer

	// scale, when set, runs rows against the filled table of RunScale.
	scale *scaleRun
	// syncProbeDir is the throwaway server's directory, where the paced
	// phase's disk probe writes (syncprobe.go); empty for DATABASE_URL.
	syncProbeDir string
	// run is the number of the run under way when Runs > 1.
	run int
}

// scaleRun is how RunScale runs a row: in its schema, whose
// processed_events is kept from row to row, with ids of its own.
type scaleRun struct {
	schema   string
	idPrefix string
}

// Result is one row of the report.
type Result struct {
	Broker Broker `json:"broker"`
	Row    Row    `json:"row"`
	// Run numbers the run (from 1) when Options.Runs > 1; 0 otherwise.
	// Ratios compare rows of the same run.
	Run int `json:"run,omitempty"`
	// Messages consumed in the measured (backlog) phase.
	Messages int     `json:"messages"`
	Seconds  float64 `json:"seconds"`
	Rate     float64 `json:"msgs_per_s"`
	// IdlePct is the share (percent) of 10 ms samples of the backlog
	// phase in which the row held no delivery, every one it had received
	// acked: time it waited for the broker with the backlog queued there.
	// A scale-out row gives its processes' mean, weighted by their shares.
	IdlePct float64 `json:"idle_pct"`
	// P50 and P99 are produce-to-ack latencies in the paced phase, at
	// PacedRate msgs/s (half of Rate, capped by Options.PaceMax).
	P50Ms float64 `json:"p50_ms"`
	P99Ms float64 `json:"p99_ms"`
	// ReceiveP50Ms and ReceiveP99Ms are the produce-to-Receive part: what
	// the broker and the adapter take before the consumer sees a message.
	ReceiveP50Ms float64 `json:"receive_p50_ms"`
	ReceiveP99Ms float64 `json:"receive_p99_ms"`
	PacedTarget  float64 `json:"paced_target_msgs_per_s"`
	PacedRate    float64 `json:"paced_msgs_per_s"`
	PacedMsgs    int     `json:"paced_messages"`
	// DiskSyncP99Ms and DiskSyncMaxMs are the p99 and the longest of the
	// disk probe's 8 KiB write-and-fdatasync, every 10 ms beside the
	// throwaway server's data over the measured part of the paced phase:
	// what the WAL flush of a commit met (0: no probe, DATABASE_URL).
	DiskSyncP99Ms float64 `json:"disk_sync_p99_ms"`
	DiskSyncMaxMs float64 `json:"disk_sync_max_ms"`
	// WakeLagP99Ms and WakeLagMaxMs are how late a goroutine of the row's
	// process that sleeps 1 ms woke, over the same part of the paced
	// phase: the time every goroutine of the consumer waited for a core.
	WakeLagP99Ms float64 `json:"wake_lag_p99_ms"`
	WakeLagMaxMs float64 `json:"wake_lag_max_ms"`
	// AllocsPerMsg is the row subprocess's heap allocations per message in
	// the backlog phase (runtime.MemStats.Mallocs).
	AllocsPerMsg float64 `json:"allocs_per_msg"`
	// PeakRSSMB is the row subprocess's VmHWM once the backlog was consumed.
	PeakRSSMB float64 `json:"peak_rss_mb"`
	// HeapSysMB and HeapInuseMB are the Go heap of the subprocess at the
	// end of the backlog phase.
	HeapSysMB   float64 `json:"heap_sys_mb"`
	HeapInuseMB float64 `json:"heap_inuse_mb"`
	// RoundTrips is the round trips to PostgreSQL in the backlog phase
	// and Transactions its commits; RoundTripsPerTx and MsgsPerTx follow.
	RoundTrips      int64   `json:"round_trips"`
	Transactions    int64   `json:"transactions"`
	RoundTripsPerTx float64 `json:"round_trips_per_tx"`
	MsgsPerTx       float64 `json:"msgs_per_tx"`
	// VsNaive and VsCeiling are Rate over the naive row's and over the lower
	// ceiling's rate; 0 (in the table "-") when the run had no such row.
	VsNaive   float64 `json:"x_naive"`
	VsCeiling float64 `json:"x_lower_ceiling"`
	// VsHandwritten is Rate over the hand-written batched row's; 0 when
	// the run had none.
	VsHandwritten float64 `json:"x_handwritten"`
	// RatioRowsWrong names the rows the ratios compare with (naive,
	// ceiling, hand-written batched, of the same broker and run) whose
	// effects were wrong or that failed: a ratio against one compares with
	// work not done right, or not measured, and judges no target (in the
	// table it is marked "*").
	RatioRowsWrong []Row `json:"ratio_rows_wrong,omitempty"`
	// Correct says whether the effects were exactly right; Check says what
	// was counted.
	Correct bool   `json:"correct"`
	Check   string `json:"check"`
	// Error says why the row failed: its backlog could not be published,
	// its subprocess exited with an error, or its effects could not be
	// counted. Correct is then false, and the figures are those measured
	// before it failed (none when the subprocess failed). Empty when the
	// row ran to its end.
	Error string `json:"error,omitempty"`
	// Stats are the library consumer's counters (once rows only).
	Stats *consumer.Stats `json:"stats,omitempty"`
	// Processes and Shares: the processes that ran the row together and
	// each one's acks (Options.Processes; empty for one).
	Processes int   `json:"processes,omitempty"`
	Shares    []int `json:"process_shares,omitempty"`
}

// Machine describes where the run happened.
type Machine struct {
	CPUs              int    `json:"cpus"`
	MemoryMB          int64  `json:"memory_mb"`
	Postgres          string `json:"postgres"`
	Fsync             string `json:"fsync"`
	SynchronousCommit string `json:"synchronous_commit"`
	Throwaway         bool   `json:"throwaway_postgres"`
	// WAL is what was done to the throwaway server's WAL before the rows
	// (warmWAL); nil on a server named by DATABASE_URL.
	WAL *walWarm `json:"wal_warm,omitempty"`
	Go  string   `json:"go"`
}

// Report is a whole run.
type Report struct {
	Started  time.Time `json:"started"`
	Machine  Machine   `json:"machine"`
	Workload Workload  `json:"workload"`
	// AMQPLazy: the RabbitMQ rows' queues were lazy (Options.AMQPLazy).
	AMQPLazy bool `json:"amqp_lazy,omitempty"`
	// PGNoFsync: the throwaway PostgreSQL ran without fsync
	// (Options.PGNoFsync), a diagnostic on which no target is judged.
	PGNoFsync bool `json:"pg_no_fsync,omitempty"`
	// KafkaDir and RabbitMQDir are where the throwaway Apache Kafka node
	// and RabbitMQ node kept their files (Options.KafkaDir; the
	// ONCE_RABBITMQ_DIR that scripts/rabbitmq.sh exports), when known.
	KafkaDir    string `json:"kafka_dir,omitempty"`
	RabbitMQDir string `json:"rabbitmq_dir,omitempty"`
	// PostgresDir is the throwaway PostgreSQL's data directory (empty for
	// DATABASE_URL).
	PostgresDir string `json:"postgres_dir,omitempty"`
	// PGBench is the database ceiling in rows/s (0 when skipped).
	PGBench     float64  `json:"pgbench_rows_per_s"`
	PGBenchTPS  float64  `json:"pgbench_tps"`
	PGBenchArgs string   `json:"pgbench_command"`
	Results     []Result `json:"rows"`
	// PaceSeconds and PaceMax describe the paced latency phase.
	PaceSeconds float64 `json:"pace_seconds"`
	PaceMax     float64 `json:"pace_max_msgs_per_s"`
	// HTTP are the HTTP command rows, if run.
	HTTP *HTTPReport `json:"http,omitempty"`
	// Outbox are the outbox rows of each broker, if run.
	Outbox []OutboxResult `json:"outbox,omitempty"`
}

func (o *Options) logf(format string, args ...any) {
	if o.Log != nil {
		fmt.Fprintf(o.Log, format+"\n", args...)
	}
}

// Run runs the benchmark and returns its report. A row whose effects are
// wrong is reported with Correct false; a row that fails (its backlog
// cannot be published, its subprocess exits with an error, its effects
// cannot be counted) is reported with Error set and Correct false, and the
// rows after it still run; so is an outbox row that fails, and every row
// of a broker that does not start. Run fails when it cannot start (the
// database, pgbench, RabbitMQ without AMQPURL); when ctx is done, it
// returns the report of the rows so far with ctx's error.
func Run(ctx context.Context, o Options) (*Report, error) {
	if o.KeyLanes <= 0 {
		o.KeyLanes = 4
	}
	if o.BatchSize <= 0 {
		o.BatchSize = 100
	}
	if o.NaiveWorkers <= 0 {
		o.NaiveWorkers = o.Workload.Partitions
	}
	if o.PaceMax <= 0 {
		o.PaceMax = 50000
	}
	if slices.Contains(o.Brokers, RabbitMQ) && o.AMQPURL == "" {
		return nil, errors.New("RabbitMQ rows need AMQP_URL (make bench starts a node with scripts/rabbitmq.sh)")
	}
	rep := &Report{Started: time.Now().UTC(), Workload: o.Workload, AMQPLazy: o.AMQPLazy, PGNoFsync: o.PGNoFsync, RabbitMQDir: os.Getenv("ONCE_RABBITMQ_DIR"), PaceSeconds: o.Pace.Seconds(), PaceMax: o.PaceMax}
	if o.PGNoFsync && o.DatabaseURL != "" {
		return nil, errors.New("PGNoFsync (-pg-no-fsync) applies to the throwaway server: unset DATABASE_URL")
	}
	if o.DatabaseURL == "" {
		o.logf("starting a throwaway PostgreSQL (fsync %s)", map[bool]string{true: "off: a diagnostic run", false: "on"}[o.PGNoFsync])
		srv, err := pgtemp.Start(ctx, pgtemp.Options{Durable: !o.PGNoFsync})
		if err != nil {
			return nil, err
		}
		defer srv.Close()
		o.DatabaseURL = srv.URL()
		o.syncProbeDir = srv.Dir()
		rep.PostgresDir = srv.Dir()
		rep.Machine.Throwaway = true
		if os.Getenv(ProfileEnv) != "" {
			if err := enableStatStatements(ctx, srv); err != nil {
				return nil, fmt.Errorf("pg_stat_statements: %w", err)
			}
		}
	}
	db, err := pgxpool.New(ctx, o.DatabaseURL)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	if err := machine(ctx, db, &rep.Machine); err != nil {
		return nil, err
	}
	if rep.Machine.Throwaway {
		o.logf("making the throwaway server's WAL segments (as a server that has run a while has them)")
		w, err := warmWAL(ctx, db, 0)
		if err != nil {
			return nil, fmt.Errorf("WAL segments: %w", err)
		}
		rep.Machine.WAL = &w
	}

	if o.PGBench > 0 {
		o.logf("ceiling 2: pgbench for %s", o.PGBench)
		if err := runPGBench(ctx, db, o, rep); err != nil {
			return nil, err
		}
	}

	if slices.Contains(o.Brokers, ApacheKafka) {
		rep.KafkaDir = cmp.Or(o.KafkaDir, os.TempDir())
	}
	for _, b := range o.Brokers {
		var kc *kafkaCluster
		if b.IsKafka() {
			if kc, err = startKafka(ctx, b, o.KafkaDir); err != nil {
				if ctx.Err() != nil {
					ratios(rep)
					return rep, ctx.Err()
				}
				failBroker(rep, o, b, fmt.Errorf("%s did not start: %w", b, err))
				continue
			}
			defer kc.Close()
		}
		for run := range max(1, o.Runs) {
			for _, row := range o.Rows {
				if !row.ForBroker(b) {
					continue
				}
				if o.Runs > 1 {
					o.run = run + 1
				}
				res, err := runRow(ctx, db, kc, o, b, row)
				if res == nil {
					res = &Result{Broker: b, Row: row}
				}
				res.Run = o.run
				if err != nil {
					res.Correct, res.Error = false, err.Error()
					o.logf("  %-9s %-19s FAILED: %v", b, row, err)
					rep.Results = append(rep.Results, *res)
					if ctx.Err() != nil {
						ratios(rep)
						return rep, ctx.Err()
					}
					continue
				}
				o.logf("  %-9s %-19s %9.0f msgs/s  p50/p99 %.1f/%.1f ms (to Receive %.1f/%.1f ms) at %.0f msgs/s  %s",
					b, row, res.Rate, res.P50Ms, res.P99Ms, res.ReceiveP50Ms, res.ReceiveP99Ms, res.PacedRate, res.Check)
				if st := res.Stats; st != nil {
					o.logf("      handled %d, duplicates %d, dead-lettered %d, retries %d, infrastructure errors %d",
						st.Handled, st.Duplicates, st.DeadLettered, st.Retries, st.InfraErrors)
				}
				rep.Results = append(rep.Results, *res)
			}
		}
		if o.OutboxRows > 0 {
			// A failed outbox row is reported as a failed consumer row is.
			res, err := runOutbox(ctx, db, kc, o, b)
			if err != nil {
				res.Correct, res.Error = false, err.Error()
				o.logf("  %-9s %-19s FAILED: %v", b, "outbox", err)
			}
			rep.Outbox = append(rep.Outbox, *res)
			if ctx.Err() != nil {
				ratios(rep)
				return rep, ctx.Err()
			}
		}
	}
	ratios(rep)
	if o.HTTPRequests > 0 {
		if rep.HTTP, err = runHTTP(ctx, db, o); err != nil {
			return nil, err
		}
	}
	return rep, nil
}

// failBroker reports every row of broker b, of every run, and its outbox
// row, failed with err: the broker did not start.
func failBroker(rep *Report, o Options, b Broker, err error) {
	o.logf("  %-9s FAILED: %v", b, err)
	for run := range max(1, o.Runs) {
		for _, row := range o.Rows {
			if !row.ForBroker(b) {
				continue
			}
			res := Result{Broker: b, Row: row, Error: err.Error()}
			if o.Runs > 1 {
				res.Run = run + 1
			}
			rep.Results = append(rep.Results, res)
		}
	}
	if o.OutboxRows > 0 {
		rep.Outbox = append(rep.Outbox, OutboxResult{Broker: b, Rows: o.OutboxRows, BatchSize: outbox.DefaultBatchSize, Rounds: outboxRounds, Error: err.Error()})
	}
}

// ratios fills VsNaive, VsCeiling and VsHandwritten against the rows of
// the same broker and run: the lower ceiling of a broker is the lower of
// its source ceiling and pgbench's rows/s.
//
// A ratio against a row whose effects were wrong, or that failed, is
// still given (0 when that row measured nothing), and the row named in
// RatioRowsWrong.
func ratios(rep *Report) {
	for i := range rep.Results {
		r := &rep.Results[i]
		var naive, ceiling, hand float64
		r.RatioRowsWrong = nil
		for _, o := range rep.Results {
			if o.Broker != r.Broker || o.Run != r.Run {
				continue
			}
			if o.Row.isRatioBase() && !o.Correct && !slices.Contains(r.RatioRowsWrong, o.Row) {
				r.RatioRowsWrong = append(r.RatioRowsWrong, o.Row)
			}
			switch o.Row {
			case RowNaive:
				naive = o.Rate
			case RowCeiling:
				ceiling = o.Rate
			case RowHandwritten:
				hand = o.Rate
			}
		}
		if rep.PGBench > 0 && (ceiling == 0 || rep.PGBench < ceiling) {
			ceiling = rep.PGBench
		}
		if naive > 0 {
			r.VsNaive = r.Rate / naive
		}
		if ceiling > 0 {
			r.VsCeiling = r.Rate / ceiling
		}
		if hand > 0 {
			r.VsHandwritten = r.Rate / hand
		}
	}
}

// isRatioBase reports whether the ratios compare rows with this one.
func (r Row) isRatioBase() bool { return r == RowNaive || r == RowCeiling || r == RowHandwritten }

// ratioRowWrong reports whether the ratio against row compares with a
// row whose effects were wrong or that failed.
func (r *Result) ratioRowWrong(row Row) bool { return slices.Contains(r.RatioRowsWrong, row) }

// schemaName is the schema of a row's tables: an identifier dedup accepts
// (apache-kafka's hyphen, like the rows' spaces, becomes an underscore).
func schemaName(b Broker, row Row) string {
	return strings.NewReplacer(" ", "_", "-", "_").Replace("oncebench_" + string(b) + "_" + string(row))
}

// runRow publishes the backlog, runs the row in a subprocess and checks
// what it left.
func runRow(ctx context.Context, db *pgxpool.Pool, kc *kafkaCluster, o Options, b Broker, row Row) (*Result, error) {
	name := strings.ReplaceAll(string(row), " ", "-")
	backlog := o.Workload.Counts()
	schema, prefix := schemaName(b, row), "ev-"
	if o.scale != nil {
		schema, prefix = o.scale.schema, o.scale.idPrefix
	}
	spec := &rowSpec{
		Row: row, Broker: b, DatabaseURL: o.DatabaseURL, Schema: schema,
		Backlog: backlog.Messages, BatchSize: o.BatchSize, Naive: o.NaiveWorkers, Concurrency: o.Concurrency,
		Ordered: o.AMQPOrdered && row != RowNaive, Lazy: o.AMQPLazy,
		Pace: o.Pace, PaceMax: o.PaceMax, PaceWork: o.Workload, PacedPrefix: "paced-", SyncProbeDir: o.syncProbeDir, Run: o.run,
		Timeout: time.Minute + time.Duration(backlog.Messages)*time.Millisecond,
	}
	if row == RowOnceKeyLanes {
		spec.KeyLanes = o.KeyLanes
	}
	if o.scale != nil {
		// The filled processed_events stays; only the business rows go.
		if _, err := db.Exec(ctx, `TRUNCATE `+pgx.Identifier{schema, "effects"}.Sanitize()); err != nil {
			return nil, err
		}
	} else {
		if err := createSchema(ctx, db, spec.Schema); err != nil {
			return nil, err
		}
		defer dropSchema(db, spec.Schema)
	}
	switch b {
	case Kafka, ApacheKafka:
		spec.Brokers = kc.addrs
		spec.Topic = fmt.Sprintf("bench-%s-%d", name, time.Now().UnixNano())
		spec.Group = spec.Topic + "-group"
		if err := kc.createTopics(spec.Topic, o.Workload.Partitions); err != nil {
			return nil, err
		}
		if err := produceBacklog(kc.addrs, spec.Topic, prefix, o.Workload); err != nil {
			return nil, fmt.Errorf("produce: %w", err)
		}
	case RabbitMQ:
		spec.AMQPURL = o.AMQPURL
		spec.Queue = fmt.Sprintf("oncebench.%s.%d", name, time.Now().UnixNano())
		if err := declareQueue(o.AMQPURL, spec.Queue, amqpQueueArgs(spec.Lazy)); err != nil {
			return nil, err
		}
		defer deleteQueues(o.AMQPURL, spec.Queue)
		if err := publishBacklog(o.AMQPURL, spec.Queue, prefix, o.Workload); err != nil {
			return nil, fmt.Errorf("publish: %w", err)
		}
	default:
		return nil, fmt.Errorf("unknown broker %q", b)
	}

	profileDir := os.Getenv(ProfileEnv)
	statements := profileDir != "" && resetStatStatements(ctx, db)
	var cr *childResult
	var shares []int
	var err error
	if o.Processes > 1 {
		spec.Pace = 0
		if err := createProgressTable(ctx, db, spec.Schema); err != nil {
			return nil, err
		}
		cr, shares, err = runProcesses(ctx, spec, o.Processes, rowDeadline(o, spec))
	} else {
		cr, err = runSubprocess(ctx, spec, rowDeadline(o, spec))
	}
	if err != nil {
		return nil, err
	}
	if statements {
		if err := writeStatStatements(ctx, db, profileDir, b, row); err != nil {
			return nil, fmt.Errorf("pg_stat_statements: %w", err)
		}
	}
	res := &Result{
		Broker: b, Row: row, Messages: cr.Messages, Seconds: cr.Seconds, Rate: cr.Rate, IdlePct: 100 * cr.IdleShare,
		P50Ms: ms(cr.P50), P99Ms: ms(cr.P99), ReceiveP50Ms: ms(cr.ReceiveP50), ReceiveP99Ms: ms(cr.ReceiveP99), PacedTarget: cr.PacedTarget, PacedRate: cr.PacedRate, PacedMsgs: cr.Paced.Messages,
		DiskSyncP99Ms: ms(cr.SyncP99), DiskSyncMaxMs: ms(cr.SyncMax), WakeLagP99Ms: ms(cr.LagP99), WakeLagMaxMs: ms(cr.LagMax),
		AllocsPerMsg: cr.AllocsPerMsg, PeakRSSMB: float64(cr.RSSKB) / 1024,
		HeapSysMB: float64(cr.HeapSysKB) / 1024, HeapInuseMB: float64(cr.HeapInuseKB) / 1024,
		RoundTrips: cr.RoundTrips, Transactions: cr.Commits,
	}
	if len(shares) > 1 {
		res.Processes, res.Shares = len(shares), shares
	}
	if cr.Commits > 0 {
		res.RoundTripsPerTx = float64(cr.RoundTrips) / float64(cr.Commits)
		res.MsgsPerTx = float64(cr.Messages) / float64(cr.Commits)
	}
	parts := []consumed{{prefix, o.Workload}}
	if cr.Paced.Messages > 0 {
		paced := spec.PaceWork
		paced.Events = cr.PacedEvents
		parts = append(parts, consumed{spec.PacedPrefix, paced})
	}
	res.Correct, res.Check, err = check(ctx, db, kc, spec, row, parts...)
	if st := cr.Stats; st != nil {
		res.Stats = st
	}
	return res, err
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// rowDeadline is how long a row's subprocess may run before it is killed:
// o.RowTimeout, or by default three times the time each of its phases may
// take (spec.Timeout: peers, backlog, paced wait), its paced phase and a
// minute to start and stop.
func rowDeadline(o Options, spec *rowSpec) time.Duration {
	if o.RowTimeout > 0 {
		return o.RowTimeout
	}
	return 3*spec.Timeout + spec.Pace + time.Minute
}

// runSubprocess runs spec in a subprocess of this executable and returns
// what it reported. A subprocess still running after deadline is killed,
// and runSubprocess fails saying so.
func runSubprocess(ctx context.Context, spec *rowSpec, deadline time.Duration) (*childResult, error) {
	raw, err := json.Marshal(spec)
	if err != nil {
		return nil, err
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	dctx, cancel := context.WithTimeout(ctx, deadline)
	defer cancel()
	cmd := exec.CommandContext(dctx, exe)
	// Killed, it cannot hold its output open; WaitDelay bounds the wait
	// anyway.
	cmd.WaitDelay = 10 * time.Second
	cmd.Env = append(os.Environ(), childEnv+"="+string(raw))
	// The subprocess says why it failed on stderr: pass it on, and keep
	// its last line for the report.
	last := &lastLine{}
	cmd.Stderr = io.MultiWriter(os.Stderr, last)
	out, err := cmd.Output()
	if err != nil {
		if ctx.Err() == nil && errors.Is(dctx.Err(), context.DeadlineExceeded) {
			return nil, fmt.Errorf("row subprocess: killed after its deadline of %s (Options.RowTimeout, oncebench -row-timeout): %w", deadline, err)
		}
		if l := last.String(); l != "" {
			return nil, fmt.Errorf("row subprocess: %w: %s", err, l)
		}
		return nil, fmt.Errorf("row subprocess: %w", err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	var cr childResult
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &cr); err != nil {
		return nil, fmt.Errorf("row subprocess output %q: %w", out, err)
	}
	return &cr, nil
}

// lastLine keeps the last non-empty line written to it (at most 1 KiB of
// it).
type lastLine struct {
	buf []byte
}

func (l *lastLine) Write(p []byte) (int, error) {
	l.buf = append(l.buf, p...)
	if i := bytes.LastIndexByte(bytes.TrimRight(l.buf, "\n"), '\n'); i >= 0 {
		l.buf = l.buf[i+1:]
	}
	if len(l.buf) > 1024 {
		l.buf = l.buf[len(l.buf)-1024:]
	}
	return len(p), nil
}

// String returns the last line, without its newline.
func (l *lastLine) String() string { return strings.TrimSpace(string(l.buf)) }

func createSchema(ctx context.Context, db *pgxpool.Pool, schema string) error {
	s := pgx.Identifier{schema}.Sanitize()
	_, err := db.Exec(ctx, `DROP SCHEMA IF EXISTS `+s+` CASCADE; CREATE SCHEMA `+s+`;
CREATE TABLE `+s+`.effects (event_id text NOT NULL, n bigint NOT NULL, account text NOT NULL, amount bigint NOT NULL);
CREATE TABLE `+s+`.naive_seen (id text PRIMARY KEY)`)
	return err
}

func dropSchema(db *pgxpool.Pool, schema string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, _ = db.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
}

// consumed is a workload a row consumed and the prefix of its ids.
type consumed struct {
	prefix string
	w      Workload
}

// wanted is what the parts leave when consumed exactly once: their
// counts, the business row of each valid event (event_id, n, account,
// amount), once per event, and the id of each poison message, copies
// included: the dead letters.
type wanted struct {
	Counts
	ids, accounts []string
	ns, amounts   []int64
	poison        []string
}

func wantEffects(parts []consumed) (*wanted, error) {
	w := &wanted{}
	seen := map[string]bool{}
	var err error
	for _, p := range parts {
		w.Counts = w.Add(p.w.Counts())
		p.w.Each(p.prefix, func(m Msg) bool {
			if m.Poison {
				w.poison = append(w.poison, m.ID)
				return true
			}
			if seen[m.ID] {
				return true
			}
			seen[m.ID] = true
			var pl payload
			if err = json.Unmarshal(m.Value, &pl); err != nil {
				return false
			}
			w.ids, w.ns, w.accounts, w.amounts = append(w.ids, m.ID), append(w.ns, pl.N), append(w.accounts, pl.Account), append(w.amounts, pl.Amount)
			return true
		})
		if err != nil {
			return nil, err
		}
	}
	return w, nil
}

// check counts what a row left: business rows and their distinct ids
// against the valid events, and that each is the business row of a valid
// event, with its values, one per valid event; dead letters against the
// poison messages, each one's copy; and unacknowledged messages (Kafka:
// committed offsets below the end of a partition; RabbitMQ: messages left
// in the queue).
func check(ctx context.Context, db *pgxpool.Pool, kc *kafkaCluster, spec *rowSpec, row Row, of ...consumed) (bool, string, error) {
	want, err := wantEffects(of)
	if err != nil {
		return false, "", err
	}
	ok := true
	var parts []string
	if row != RowCeiling {
		var rows, distinct, missing, stray int
		s := pgx.Identifier{spec.Schema}.Sanitize()
		if err := db.QueryRow(ctx, `WITH want (event_id, n, account, amount) AS (
  SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[]))
SELECT (SELECT count(*) FROM `+s+`.effects), (SELECT count(DISTINCT event_id) FROM `+s+`.effects),
  (SELECT count(*) FROM want w WHERE NOT EXISTS (SELECT FROM `+s+`.effects e
    WHERE (e.event_id, e.n, e.account, e.amount) = (w.event_id, w.n, w.account, w.amount))),
  (SELECT count(*) FROM `+s+`.effects e WHERE NOT EXISTS (SELECT FROM want w
    WHERE (e.event_id, e.n, e.account, e.amount) = (w.event_id, w.n, w.account, w.amount)))`,
			want.ids, want.ns, want.accounts, want.amounts).Scan(&rows, &distinct, &missing, &stray); err != nil {
			return false, "", err
		}
		ok = ok && rows == want.Valid && distinct == want.Valid && missing == 0 && stray == 0
		parts = append(parts, fmt.Sprintf("rows %d distinct %d/%d", rows, distinct, want.Valid))
		if missing > 0 || stray > 0 {
			parts = append(parts, fmt.Sprintf("valid events without their row %d, rows of no valid event %d", missing, stray))
		}
	}
	var dead, unacked int
	var deadIDs func() ([]string, error)
	switch spec.Broker {
	case Kafka, ApacheKafka:
		var err error
		if dead, err = topicCount(kc.addrs, spec.Topic+".dlq"); err != nil {
			return false, "", err
		}
		if unacked, err = uncommitted(kc.addrs, spec.Group, spec.Topic); err != nil {
			return false, "", err
		}
		deadIDs = func() ([]string, error) { return topicIDs(kc.addrs, spec.Topic+".dlq") }
	case RabbitMQ:
		var err error
		if unacked, dead, err = queueCounts(spec.AMQPURL, spec.Queue); err != nil {
			return false, "", err
		}
		deadIDs = func() ([]string, error) { return queueIDs(spec.AMQPURL, spec.Queue+amqp.DeadLetterQueueSuffix, dead) }
	}
	if row == RowCeiling {
		// The ceiling acks poison like any message: nothing is dead-lettered.
		ok = ok && dead == 0
	} else {
		ok = ok && dead == want.Poison
		parts = append(parts, fmt.Sprintf("dlq %d/%d", dead, want.Poison))
		if dead == want.Poison && dead > 0 {
			got, err := deadIDs()
			if err != nil {
				return false, "", fmt.Errorf("dead letters: %w", err)
			}
			if n := unmatched(got, want.poison); n > 0 {
				ok = false
				parts = append(parts, fmt.Sprintf("dead letters of no poison message %d", n))
			}
		}
	}
	ok = ok && unacked == 0
	parts = append(parts, fmt.Sprintf("unacked %d", unacked))
	return ok, strings.Join(parts, ", "), nil
}

// unmatched returns how many of got are not in want, each of want
// matching one of got.
func unmatched(got, want []string) int {
	left := map[string]int{}
	for _, id := range want {
		left[id]++
	}
	n := 0
	for _, id := range got {
		if left[id] == 0 {
			n++
			continue
		}
		left[id]--
	}
	return n
}

func machine(ctx context.Context, db *pgxpool.Pool, m *Machine) error {
	m.CPUs = runtime.NumCPU()
	m.Go = runtime.Version()
	if raw, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb int64
		for _, l := range strings.Split(string(raw), "\n") {
			if _, err := fmt.Sscanf(l, "MemTotal: %d kB", &kb); err == nil {
				m.MemoryMB = kb / 1024
			}
		}
	}
	return db.QueryRow(ctx, `SELECT version(), current_setting('fsync'), current_setting('synchronous_commit')`).
		Scan(&m.Postgres, &m.Fsync, &m.SynchronousCommit)
}
