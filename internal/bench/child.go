package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/consumer"
)

// ProfileEnv names a directory: when set, each row's subprocess writes a
// CPU profile of its backlog phase there (<broker>-<row>.cpu.pprof), its
// allocations (.allocs.pprof), the deliveries it held every 10 ms of the
// backlog phase (.held.csv) and the paced phase's latencies of each
// message (.paced.csv).
const ProfileEnv = "ONCE_BENCH_PROFILE"

// childEnv holds, in a row's subprocess, the JSON of its rowSpec.
const childEnv = "ONCE_BENCH_CHILD"

// rowSpec is what a row's subprocess needs to know.
type rowSpec struct {
	Row    Row
	Broker Broker

	Brokers []string // Kafka
	Topic   string
	Group   string
	AMQPURL string // RabbitMQ
	Queue   string

	DatabaseURL string
	Schema      string

	Backlog   int // messages published before the row started
	BatchSize int
	Naive     int // workers of the naive row
	// Concurrency of the library's rows (0: its default).
	Concurrency int
	// Ordered: the RabbitMQ source puts the queue on one stream.
	Ordered bool
	// Lazy: the RabbitMQ queue is declared lazy (Options.AMQPLazy).
	Lazy bool
	// KeyLanes of the Kafka source (0: one stream per partition).
	KeyLanes int

	Pace        time.Duration // length of the paced phase; 0: none
	PaceMax     float64       // cap on the paced rate, msgs/s
	PaceWork    Workload      // shape of the paced events (Events is computed)
	PacedPrefix string
	// SyncProbeDir is where the paced phase's disk probe writes; empty:
	// no probe.
	SyncProbeDir string
	// Run numbers the run when Options.Runs > 1 (0 otherwise): the
	// profiles' file names carry it.
	Run     int
	Timeout time.Duration

	// Processes > 1: the row runs in that many processes at once, this
	// one numbered Process (from 0), sharing the backlog (scaleout.go).
	Processes, Process int
}

// childResult is what a row's subprocess reports on stdout.
type childResult struct {
	Messages     int
	Seconds      float64
	Rate         float64
	AllocsPerMsg float64
	// RSSKB is the subprocess's peak resident set (VmHWM) once the backlog
	// was consumed, before the paced phase.
	RSSKB int64
	// HeapSysKB and HeapInuseKB are the Go heap's obtained and in-use bytes
	// at the same moment, and NumGC the collections so far.
	HeapSysKB, HeapInuseKB int64
	NumGC                  uint32
	// RoundTrips and Commits are the flights of messages the row's
	// database connections sent in the backlog phase, and those that
	// carried a COMMIT (wireCounter).
	RoundTrips, Commits int64

	PacedTarget float64 // msgs/s asked for
	PacedRate   float64 // msgs/s achieved by the producer
	Paced       Counts
	// PacedEvents is the Events of the paced phase's workload (rowSpec's
	// PaceWork otherwise), whose ids start with PacedPrefix.
	PacedEvents int
	P50, P99    time.Duration
	// ReceiveP50 and ReceiveP99 are produce-to-Receive latencies: the
	// broker's and the adapter's share of P50 and P99.
	ReceiveP50, ReceiveP99 time.Duration
	// IdleShare is the share of the backlog phase in which the row held no
	// delivery: waiting for its broker (idlesample.go).
	IdleShare float64
	// SyncP99 and SyncMax are the disk probe's over the same part of the
	// paced phase (syncprobe.go).
	SyncP99, SyncMax time.Duration
	// LagP99 and LagMax are the lag probe's: how late a 1 ms sleep in this
	// process woke (syncprobe.go).
	LagP99, LagMax time.Duration

	Stats *consumer.Stats `json:",omitempty"`

	// Acked, FirstAtNs and DoneAtNs are this process's acks in the backlog
	// phase, when it received its first delivery and when the backlog was
	// done (Unix ns): what a scale-out row combines.
	Acked               int
	FirstAtNs, DoneAtNs int64
}

// RunChildIfRequested runs a row and exits when the process is a row's
// subprocess (started by Run with its own executable); otherwise it
// returns at once. Call it first thing in main, and in TestMain of tests
// that call Run.
func RunChildIfRequested() {
	raw := os.Getenv(childEnv)
	if raw == "" {
		return
	}
	var spec rowSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "oncebench child:", err)
		os.Exit(2)
	}
	res, err := runChild(&spec)
	if err != nil {
		fmt.Fprintf(os.Stderr, "oncebench child %s/%s: %v\n", spec.Broker, spec.Row, err)
		os.Exit(1)
	}
	out, _ := json.Marshal(res)
	fmt.Println(string(out))
	os.Exit(0)
}

// payload is the event the handlers decode.
type payload struct {
	N       int64  `json:"n"`
	Account string `json:"account"`
	Amount  int64  `json:"amount"`
	Note    string `json:"note"`
}

const insertEffectSQL = `INSERT INTO effects (event_id, n, account, amount) VALUES ($1, $2, $3, $4)`

func insertEffect(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
	_, err := tx.Exec(ctx, insertEffectSQL, ev.ID, ev.Payload.N, ev.Payload.Account, ev.Payload.Amount)
	return err
}

// queueEffect is insertEffect through Event.Queue: the batch's inserts
// share one round trip.
func queueEffect(_ context.Context, _ pgx.Tx, ev consumer.Event[payload]) error {
	ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N, ev.Payload.Account, ev.Payload.Amount)
	return nil
}

func insertEffects(ctx context.Context, tx pgx.Tx, evs []consumer.Event[payload]) error {
	ids := make([]string, len(evs))
	ns := make([]int64, len(evs))
	accounts := make([]string, len(evs))
	amounts := make([]int64, len(evs))
	for i, ev := range evs {
		ids[i], ns[i], accounts[i], amounts[i] = ev.ID, ev.Payload.N, ev.Payload.Account, ev.Payload.Amount
	}
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, n, account, amount)
SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[])`, ids, ns, accounts, amounts)
	return err
}

func openPool(ctx context.Context, url, schema string, conns int32, wire *wireCounter) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.DialFunc = wire.dial
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = conns
	return pgxpool.NewWithConfig(ctx, cfg)
}

func runChild(spec *rowSpec) (*childResult, error) {
	ctx := context.Background()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	var src consumer.Source
	var err error
	switch spec.Broker {
	case Kafka, ApacheKafka:
		src, err = openKafkaSource(ctx, spec, logger)
	case RabbitMQ:
		src, err = openAMQPSource(ctx, spec, logger)
	default:
		err = fmt.Errorf("unknown broker %q", spec.Broker)
	}
	if err != nil {
		return nil, err
	}
	var ms0 runtime.MemStats
	var profile *os.File
	wire := &wireCounter{}
	var writes0, commits0 int64
	m := newMeter(src, func() {
		runtime.ReadMemStats(&ms0)
		writes0, commits0 = wire.snapshot()
		if dir := os.Getenv(ProfileEnv); dir != "" {
			name := filepath.Join(dir, profileName(spec)+".cpu.pprof")
			if f, err := os.Create(name); err == nil && pprof.StartCPUProfile(f) == nil {
				profile = f
			}
		}
	})

	var pool *pgxpool.Pool
	if spec.Row != RowCeiling {
		if pool, err = openPool(ctx, spec.DatabaseURL, spec.Schema, 8, wire); err != nil {
			_ = src.Close()
			return nil, err
		}
		defer pool.Close()
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	finished := make(chan struct{})
	var runErr error
	var stats func() consumer.Stats
	var run func() error
	closeSrc := true
	switch spec.Row {
	case RowCeiling:
		run = func() error { return receiveAck(runCtx, m) }
	case RowNaive:
		run = func() error { return runNaive(runCtx, m, pool, spec) }
	case RowHandwritten:
		run = func() error { return runHandwritten(runCtx, m, pool, spec) }
	case RowOncePerMessage, RowOnceBatched, RowOnceQueued, RowOnceBatchHandler, RowOnceKeyLanes:
		cfg := consumer.Config{Name: "bench", Batch: consumer.BatchConfig{Size: spec.BatchSize}, Concurrency: spec.Concurrency, Telemetry: consumer.TelemetryConfig{Logger: logger}}
		if spec.Row == RowOncePerMessage {
			cfg.Batch.Size = 1
		}
		var c *consumer.Consumer[payload]
		switch spec.Row {
		case RowOnceBatchHandler:
			c, err = consumer.NewBatch(pool, m, insertEffects, cfg)
		case RowOnceQueued:
			c, err = consumer.New(pool, m, queueEffect, cfg)
		default:
			c, err = consumer.New(pool, m, insertEffect, cfg)
		}
		if err != nil {
			_ = src.Close()
			return nil, err
		}
		stats, run, closeSrc = c.Stats, func() error { return c.Run(runCtx) }, false
	default:
		_ = src.Close()
		return nil, fmt.Errorf("unknown row %q", spec.Row)
	}
	if spec.Processes > 1 {
		if err := awaitPeers(ctx, spec); err != nil {
			_ = src.Close()
			return nil, err
		}
	}
	idle := startIdleSampler(m)
	defer idle.Stop()
	go func() {
		runErr = run()
		close(finished)
	}()
	stop := func() error {
		cancel()
		<-finished
		if closeSrc {
			if err := src.Close(); err != nil && runErr == nil {
				runErr = err
			}
		}
		return runErr
	}
	wait := func(n int) error {
		wctx, wcancel := context.WithTimeout(ctx, spec.Timeout)
		defer wcancel()
		go func() {
			select {
			case <-finished:
				wcancel()
			case <-wctx.Done():
			}
		}()
		if err := m.waitAcked(wctx, n); err != nil {
			select {
			case <-finished:
				if runErr == nil {
					runErr = errors.New("the row returned early")
				}
				return fmt.Errorf("the row stopped after %d of %d acks: %w", m.Acked(), n, runErr)
			default:
			}
			return fmt.Errorf("%d of %d messages acked after %s: %w", m.Acked(), n, spec.Timeout, err)
		}
		return nil
	}

	backlogDone := func() error { return wait(spec.Backlog) }
	if spec.Processes > 1 {
		backlogDone = func() error { return waitShared(ctx, spec, m, finished) }
	}
	if err := backlogDone(); err != nil {
		_ = stop()
		return nil, err
	}
	doneAt := time.Now()
	idleShare := idle.Stop()
	elapsed := doneAt.Sub(m.firstAt())
	writes1, commits1 := wire.snapshot()
	if profile != nil {
		pprof.StopCPUProfile()
		_ = profile.Close()
		writeAllocsProfile(spec)
		idle.writeTimeline(filepath.Join(os.Getenv(ProfileEnv), profileName(spec)+".held.csv"), m.firstAt())
	}
	var ms1 runtime.MemStats
	runtime.ReadMemStats(&ms1)
	res := &childResult{
		Messages:     spec.Backlog,
		Seconds:      elapsed.Seconds(),
		Rate:         float64(spec.Backlog) / elapsed.Seconds(),
		IdleShare:    idleShare,
		AllocsPerMsg: float64(ms1.Mallocs-ms0.Mallocs) / float64(max(1, ownShare(spec, m))),
		RSSKB:        procStatusKB("VmHWM"),
		HeapSysKB:    int64(ms1.HeapSys / 1024),
		HeapInuseKB:  int64(ms1.HeapInuse / 1024),
		NumGC:        ms1.NumGC,
		RoundTrips:   writes1 - writes0,
		Commits:      commits1 - commits0,
		Acked:        m.Acked(),
		DoneAtNs:     doneAt.UnixNano(),
	}
	if first := m.firstAt(); !first.IsZero() {
		res.FirstAtNs = first.UnixNano()
	}

	if spec.Pace > 0 {
		if err := pace(spec, res, m, wait); err != nil {
			_ = stop()
			return nil, err
		}
	}
	if err := stop(); err != nil {
		return nil, err
	}
	if stats != nil {
		st := stats()
		res.Stats = &st
	}
	return res, nil
}

// ownShare is the messages this process handled in the backlog phase: the
// backlog, or its acks when several processes share it.
func ownShare(spec *rowSpec, m *meter) int {
	if spec.Processes > 1 {
		return m.Acked()
	}
	return spec.Backlog
}

// profileName is the stem of a row's files in the ProfileEnv directory:
// <broker>-<row>, spaces as hyphens.
func profileName(spec *rowSpec) string {
	name := strings.NewReplacer(" ", "-").Replace(string(spec.Broker) + "-" + string(spec.Row))
	if spec.Run > 0 {
		name += fmt.Sprintf("-run%d", spec.Run)
	}
	return name
}

// writeAllocsProfile writes the allocations sampled since the process
// started (the backlog phase is nearly all of them) next to the CPU
// profile: <broker>-<row>.allocs.pprof, for go tool pprof -sample_index
// alloc_space or alloc_objects.
func writeAllocsProfile(spec *rowSpec) {
	name := filepath.Join(os.Getenv(ProfileEnv), profileName(spec)+".allocs.pprof")
	f, err := os.Create(name)
	if err != nil {
		return
	}
	defer f.Close()
	_ = pprof.Lookup("allocs").WriteTo(f, 0)
}

// pace produces fresh events at half the row's measured rate (capped at
// PaceMax) for spec.Pace and records their produce-to-ack latencies.
func pace(spec *rowSpec, res *childResult, m *meter, wait func(int) error) error {
	rate := min(res.Rate/2, spec.PaceMax)
	w := spec.PaceWork
	perEvent := 1.0
	if w.DupEvery > 0 {
		perEvent += 1 / float64(w.DupEvery)
	}
	w.Events = max(1, int(rate*spec.Pace.Seconds()/perEvent))
	counts := w.Counts()
	var send func(Msg) error
	var closer func() error
	switch spec.Broker {
	case Kafka, ApacheKafka:
		p, err := newKafkaPacer(spec)
		if err != nil {
			return err
		}
		send, closer = p.send, p.Close
	case RabbitMQ:
		p, err := newAMQPPacer(spec)
		if err != nil {
			return err
		}
		send, closer = p.send, p.Close
	}
	probe, lag := startSyncProbe(spec.SyncProbeDir), startLagProbe()
	defer probe.Stop()
	defer lag.Stop()
	start := time.Now()
	sent := 0
	var sendErr error
	w.Each(spec.PacedPrefix, func(msg Msg) bool {
		if d := time.Until(start.Add(time.Duration(float64(sent) / rate * float64(time.Second)))); d > 0 {
			time.Sleep(d) // pacing the producer
		}
		sendErr = send(msg)
		sent++
		return sendErr == nil
	})
	produced := time.Since(start)
	if err := closer(); sendErr == nil {
		sendErr = err
	}
	if sendErr != nil {
		return fmt.Errorf("paced produce: %w", sendErr)
	}
	err := wait(spec.Backlog + counts.Messages)
	syncs, lags := probe.Stop(), lag.Stop()
	if err != nil {
		return fmt.Errorf("paced phase: %w", err)
	}
	// The first sixth of the phase is a warm-up: the new producer connects
	// to the broker while its first messages already carry their stamps.
	lat, recv, all := m.latencies(start.Add(spec.Pace / 6))
	if all != counts.Messages {
		return fmt.Errorf("paced phase: %d latencies recorded for %d messages", all, counts.Messages)
	}
	if len(lat) == 0 {
		return fmt.Errorf("paced phase: none of its %d messages was produced after the warm-up (the first sixth of %s at %.1f msgs/s): no latency to report; a longer -pace or a higher rate", all, spec.Pace, rate)
	}
	res.PacedTarget, res.PacedRate, res.Paced, res.PacedEvents = rate, float64(sent)/produced.Seconds(), counts, w.Events
	if dir := os.Getenv(ProfileEnv); dir != "" {
		writeTimeline(filepath.Join(dir, profileName(spec)+".paced.csv"), m, start)
		if syncs != nil {
			writeProbeTimeline(filepath.Join(dir, profileName(spec)+".sync.csv"), syncs, start)
		}
		writeProbeTimeline(filepath.Join(dir, profileName(spec)+".lag.csv"), lags, start)
	}
	res.SyncP99, res.SyncMax = probeStats(syncs, start.Add(spec.Pace/6))
	res.LagP99, res.LagMax = probeStats(lags, start.Add(spec.Pace/6))
	res.P50, res.P99 = percentile(lat, 0.50), percentile(lat, 0.99)
	res.ReceiveP50, res.ReceiveP99 = percentile(recv, 0.50), percentile(recv, 0.99)
	return nil
}

// receiveAck is the first ceiling: receive and ack, no database.
func receiveAck(ctx context.Context, src consumer.Source) error {
	for {
		d, err := src.Receive(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		if err := d.Ack(ctx); err != nil {
			return err
		}
	}
}

// runNaive is the pattern most articles show: per message, a transaction
// that SELECTs the id, INSERTs it if absent and writes the business row,
// then commit and ack. spec.Naive workers: one per partition for Kafka (as
// a sarama group handler has one goroutine per claim), sharing the queue for
// RabbitMQ.
func runNaive(ctx context.Context, src consumer.Source, pool *pgxpool.Pool, spec *rowSpec) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var mu sync.Mutex
	var failed error
	fail := func(err error) {
		mu.Lock()
		if failed == nil {
			failed = err
		}
		mu.Unlock()
		cancel()
	}
	n := max(1, spec.Naive)
	chans := make([]chan consumer.Delivery, n)
	for i := range chans {
		chans[i] = make(chan consumer.Delivery, 64)
	}
	var wg sync.WaitGroup
	for i := range n {
		ch := chans[i]
		if spec.Broker == RabbitMQ {
			ch = chans[0]
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for d := range ch {
				if ctx.Err() != nil {
					continue // stopping: leave it unacked
				}
				if err := naiveHandle(ctx, pool, d); err != nil && ctx.Err() == nil {
					fail(err)
				}
			}
		}()
	}
	for {
		d, err := src.Receive(ctx)
		if err != nil {
			if ctx.Err() == nil {
				fail(err)
			}
			break
		}
		i := 0
		if p := d.Message().Partition; p >= 0 {
			i = int(p) % n
		}
		select {
		case chans[i] <- d:
		case <-ctx.Done():
		}
	}
	for _, ch := range chans {
		close(ch)
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	return failed
}

func naiveHandle(ctx context.Context, pool *pgxpool.Pool, d consumer.Delivery) error {
	m := d.Message()
	id := m.ID
	if id == "" {
		id = m.Headers["id"]
	}
	var p payload
	if err := json.Unmarshal(m.Value, &p); err != nil {
		dl := &consumer.DeadLetter{Kind: consumer.KindDecode, Error: err.Error(), Consumer: "naive", EventID: id, FailedAt: time.Now()}
		if err := d.DeadLetter(ctx, dl); err != nil {
			return err
		}
		return d.Ack(ctx)
	}
	for attempt := 1; ; attempt++ {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var one int
			err := tx.QueryRow(ctx, `SELECT 1 FROM naive_seen WHERE id = $1`, id).Scan(&one)
			if err == nil {
				return nil // seen: a duplicate
			}
			if !errors.Is(err, pgx.ErrNoRows) {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO naive_seen (id) VALUES ($1)`, id); err != nil {
				return err
			}
			_, err = tx.Exec(ctx, insertEffectSQL, id, p.N, p.Account, p.Amount)
			return err
		})
		if err == nil {
			break
		}
		// Two copies handled at once both saw "absent"; the loser's INSERT
		// failed on the key. Try again: the SELECT now finds the id.
		if ctx.Err() != nil || attempt == 5 {
			return err
		}
	}
	return d.Ack(ctx)
}

// procStatusKB reads a field of /proc/self/status in kB; 0 if absent.
func procStatusKB(field string) int64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			v, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return v
		}
	}
	return 0
}
