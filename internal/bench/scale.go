package bench

import (
	"context"
	"crypto/md5"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtemp"
)

// scaleSchema holds the filled processed_events of RunScale.
const scaleSchema = "oncebench_scale"

// The consumers of the filled rows: the two the bench runs (the library's
// rows claim as "bench", the hand-written row as "handwritten") and four
// others sharing the table, as services sharing one database do.
var scaleConsumers = []string{"bench", "handwritten", "other-0", "other-1", "other-2", "other-3"}

// fillSQL adds the rows numbered $1 to $2 of $3: 30% the library rows'
// consumer's, 30% the hand-written row's, 40% four other consumers'; ids
// are md5 hex, spread over the whole key like UUIDs; a 32-byte
// fingerprint like the library's; processed_at rising with the row number
// over the 14 days before now, as rows appended over two weeks, so that
// the oldest rows lie at the start of the table and a 7-day retention
// expires the first half of every consumer's rows.
const fillSQL = `INSERT INTO ` + scaleSchema + `.processed_events (consumer, event_id, fingerprint, processed_at, source, partition, "offset")
SELECT CASE WHEN g % 10 < 3 THEN 'bench' WHEN g % 10 < 6 THEN 'handwritten' ELSE 'other-' || (g % 4) END,
       md5(g::text) || '-f', sha256(int8send(g)),
       now() - interval '14 days' * (1 - g::float8 / $3::bigint),
       'fill', (g % 4)::int, g
FROM generate_series($1::bigint, $2::bigint) AS g`

// fillChunk is how many rows one fill statement adds.
const fillChunk = 250_000

// retentionAge is the retention window of the retention phase: rows older
// than this expire.
const retentionAge = 7 * 24 * time.Hour

// ScaleOptions configure RunScale.
type ScaleOptions struct {
	// TableRows is the size processed_events is filled to. Defaults to 10M.
	TableRows int64
	// Steps are the table sizes, as fractions of TableRows, at which the
	// rows are measured; 0 is the empty table.
	Steps []float64
	// Workload of each measured run (HashIDs is always set).
	Workload Workload
	// Rows measured at each step, on Kafka.
	Rows []Row
	// RetentionEvents is the backlog of the two runs of the retention
	// phase (without and during retention).
	RetentionEvents int
	// RetentionBatch is DeleteOlderThan's batch size.
	RetentionBatch int
	// RetentionDuty is DeleteOlderThan's dedup.DutyCycle, in (0, 1]: 0 is
	// the consumer's default (consumer.RetentionConfig.DutyCycle, 0.1), 1
	// deletes at full speed. RunScale refuses one above 1 before it
	// starts.
	RetentionDuty float64
	// BatchSize of the batched rows.
	BatchSize int
	// DatabaseURL is the PostgreSQL server; empty starts a durable
	// throwaway one.
	DatabaseURL string
	// Log receives progress lines; nil discards them.
	Log io.Writer
}

// TableSize is processed_events' size at one moment.
type TableSize struct {
	Rows int64 `json:"rows"`
	// HeapBytes is the table without its indexes (pg_table_size).
	HeapBytes int64 `json:"heap_bytes"`
	// PKBytes is the primary key (consumer, event_id), which every claim
	// probes; IndexBytes is every index together.
	PKBytes    int64 `json:"pk_bytes"`
	IndexBytes int64 `json:"index_bytes"`
	DeadTuples int64 `json:"dead_tuples"`
}

// BytesPerRow returns the table and its indexes over its rows.
func (s TableSize) BytesPerRow() float64 {
	if s.Rows == 0 {
		return 0
	}
	return float64(s.HeapBytes+s.IndexBytes) / float64(s.Rows)
}

// FillStep is one step of the fill: the rows it added and how long they
// took (the statements and the VACUUM ANALYZE after them).
type FillStep struct {
	Added   int64     `json:"added"`
	Seconds float64   `json:"seconds"`
	Vacuum  float64   `json:"vacuum_seconds"`
	Size    TableSize `json:"size"`
}

// ScalePoint is one row measured at one table size.
type ScalePoint struct {
	TableRows int64   `json:"table_rows"`
	Row       Row     `json:"row"`
	Rate      float64 `json:"msgs_per_s"`
	// VsEmpty is Rate over the same row's on the empty table.
	VsEmpty float64 `json:"x_empty"`
	Correct bool    `json:"correct"`
	Check   string  `json:"check"`
	// Load is the 1-minute load average when the row ended.
	Load string `json:"load"`
}

// RetentionResult is the retention phase: the same row and backlog
// without retention and while DeleteOlderThan expires every consumer's
// rows older than 7 days.
type RetentionResult struct {
	Row      Row `json:"row"`
	Messages int `json:"messages"`
	// Batch is DeleteOlderThan's batch size, Duty its duty cycle.
	Batch       int     `json:"retention_batch"`
	Duty        float64 `json:"retention_duty"`
	RateWithout float64 `json:"msgs_per_s_without"`
	RateDuring  float64 `json:"msgs_per_s_during"`
	Ratio       float64 `json:"ratio"`
	Correct     bool    `json:"correct"`
	Check       string  `json:"check"`
	// RowSeconds is how long the row ran, RetentionSeconds how long the
	// whole retention took (it started with the row and went on after it
	// when it had more to delete), and Overlap the share of the row's time
	// during which retention ran.
	RowSeconds       float64 `json:"row_seconds"`
	RetentionSeconds float64 `json:"retention_seconds"`
	Overlap          float64 `json:"overlap"`
	Deleted          int64   `json:"deleted"`
	// Statements is how many DELETE statements retention ran, and
	// StatementP50Ms and StatementMaxMs how long they took.
	Statements       int     `json:"statements"`
	StatementP50Ms   float64 `json:"statement_p50_ms"`
	StatementMaxMs   float64 `json:"statement_max_ms"`
	DeletedPerSecond float64 `json:"deleted_per_s"`
	// DeletedDuringRow is how many rows retention had deleted when the
	// row ended.
	DeletedDuringRow int64 `json:"deleted_during_row"`
	// LockWaitSamples of Samples (one each 100 ms while retention ran)
	// saw a session waiting for a lock; MaxLockWaiters is the most at once.
	Samples         int `json:"samples"`
	LockWaitSamples int `json:"lock_wait_samples"`
	MaxLockWaiters  int `json:"max_lock_waiters"`
	// LockWaitEvents counts the waiting sessions seen by wait event
	// (extend: a relation extension lock; transactionid, tuple: a row).
	LockWaitEvents map[string]int `json:"lock_wait_events"`
	// Before and After are the table before the retention phase and right
	// after retention ended; AfterVacuum after a VACUUM.
	Before        TableSize `json:"before"`
	After         TableSize `json:"after"`
	AfterVacuum   TableSize `json:"after_vacuum"`
	VacuumSeconds float64   `json:"vacuum_seconds"`
	// Keyset is a second sweep after the VACUUM, of the rows older than
	// half the retention window, by the statement proposed for dedup
	// (keysetRetentionSQL), while the row runs once more.
	Keyset         *Sweep `json:"keyset,omitempty"`
	AutovacuumRuns int64  `json:"autovacuum_runs"`
	Load           string `json:"load"`
}

// ScaleReport is a whole RunScale.
type ScaleReport struct {
	Started  time.Time         `json:"started"`
	Machine  Machine           `json:"machine"`
	Settings map[string]string `json:"postgres_settings"`
	Workload Workload          `json:"workload"`
	Fill     []FillStep        `json:"fill"`
	Points   []ScalePoint      `json:"points"`
	// Plans are EXPLAIN (ANALYZE, BUFFERS) of a 100-id claim (90 new ids,
	// 10 already there) on the full table: the library's batch claim and
	// the hand-written one.
	Plans     map[string]string `json:"plans"`
	Retention *RetentionResult  `json:"retention,omitempty"`
	Seconds   float64           `json:"seconds"`
}

func (o *ScaleOptions) logf(format string, args ...any) {
	if o.Log != nil {
		fmt.Fprintf(o.Log, format+"\n", args...)
	}
}

func (o *ScaleOptions) defaults() {
	if o.TableRows <= 0 {
		o.TableRows = 10_000_000
	}
	if len(o.Steps) == 0 {
		o.Steps = []float64{0, 0.1, 0.3, 1}
	}
	if o.Workload.Events <= 0 {
		o.Workload = Workload{Events: 50000, DupEvery: 10, PoisonEvery: 1000, Partitions: 4}
	}
	o.Workload.HashIDs = true
	if len(o.Rows) == 0 {
		o.Rows = []Row{RowHandwritten, RowOnceQueued, RowOnceBatchHandler}
	}
	if o.RetentionEvents <= 0 {
		o.RetentionEvents = 200000
	}
	if o.RetentionBatch <= 0 {
		o.RetentionBatch = 5000
	}
	if o.RetentionDuty <= 0 {
		o.RetentionDuty = 0.1
	}
	if o.BatchSize <= 0 {
		o.BatchSize = 100
	}
	slices.Sort(o.Steps)
}

// RunScale measures the batched rows as processed_events grows to
// TableRows (filled in SQL, between the steps), the claim's plan on the
// full table, and then retention while consuming.
func RunScale(ctx context.Context, o ScaleOptions) (*ScaleReport, error) {
	o.defaults()
	// What the retention phase, at the end, would refuse is refused now,
	// before the fill and the rows.
	if o.RetentionDuty > 1 {
		return nil, fmt.Errorf("RetentionDuty %v is not in (0, 1]", o.RetentionDuty)
	}
	rep := &ScaleReport{Started: time.Now().UTC(), Workload: o.Workload, Plans: map[string]string{}}
	if o.DatabaseURL == "" {
		o.logf("starting a throwaway PostgreSQL (fsync on)")
		srv, err := pgtemp.Start(ctx, pgtemp.Options{Durable: true})
		if err != nil {
			return nil, err
		}
		defer srv.Close()
		o.DatabaseURL = srv.URL()
		rep.Machine.Throwaway = true
	}
	db, err := pgxpool.New(ctx, o.DatabaseURL)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	if err := machine(ctx, db, &rep.Machine); err != nil {
		return nil, err
	}
	if rep.Settings, err = postgresSettings(ctx, db); err != nil {
		return nil, err
	}
	if err := createSchema(ctx, db, scaleSchema); err != nil {
		return nil, err
	}
	defer dropSchema(db, scaleSchema)
	store, err := dedup.New(dedup.Config{Schema: scaleSchema})
	if err != nil {
		return nil, err
	}
	if err := store.Migrate(ctx, db); err != nil {
		return nil, err
	}
	kc, err := startKafka(ctx, Kafka, "")
	if err != nil {
		return nil, err
	}
	defer kc.Close()

	ro := Options{Workload: o.Workload, BatchSize: o.BatchSize, NaiveWorkers: o.Workload.Partitions,
		DatabaseURL: o.DatabaseURL, Log: o.Log, scale: &scaleRun{schema: scaleSchema}}
	var filled int64
	runs := 0
	for _, f := range o.Steps {
		target := int64(f * float64(o.TableRows))
		if target > filled {
			step, err := fill(ctx, db, &o, filled, target)
			if err != nil {
				return nil, err
			}
			rep.Fill = append(rep.Fill, *step)
			filled = target
		}
		size, err := tableSize(ctx, db)
		if err != nil {
			return nil, err
		}
		for _, row := range o.Rows {
			runs++
			ro.scale.idPrefix = fmt.Sprintf("s%d-", runs)
			res, err := runRow(ctx, db, kc, ro, Kafka, row)
			if err != nil {
				return nil, fmt.Errorf("%s at %d rows: %w", row, size.Rows, err)
			}
			p := ScalePoint{TableRows: size.Rows, Row: row, Rate: res.Rate, Correct: res.Correct, Check: res.Check, Load: loadAvg()}
			rep.Points = append(rep.Points, p)
			o.logf("  %10d rows  %-20s %7.0f msgs/s  load %s  %s", p.TableRows, row, p.Rate, p.Load, p.Check)
		}
	}
	vsEmpty(rep.Points)

	if err := explainClaims(ctx, o.DatabaseURL, store, rep.Plans); err != nil {
		return nil, fmt.Errorf("explain: %w", err)
	}
	runs++
	ro.scale.idPrefix = fmt.Sprintf("s%d-", runs)
	if rep.Retention, err = retentionPhase(ctx, db, kc, store, ro, &o, rep); err != nil {
		return nil, fmt.Errorf("retention: %w", err)
	}
	rep.Seconds = time.Since(rep.Started).Seconds()
	return rep, nil
}

// fill adds rows from+1..to to processed_events, then VACUUM ANALYZE, so
// that each step starts from a table autovacuum has caught up with.
func fill(ctx context.Context, db *pgxpool.Pool, o *ScaleOptions, from, to int64) (*FillStep, error) {
	o.logf("filling processed_events from %d to %d rows", from, to)
	start := time.Now()
	if err := fillRange(ctx, db, from, to, o.TableRows); err != nil {
		return nil, err
	}
	step := &FillStep{Added: to - from, Seconds: time.Since(start).Seconds()}
	start = time.Now()
	if _, err := db.Exec(ctx, `VACUUM (ANALYZE) `+pgx.Identifier{scaleSchema, "processed_events"}.Sanitize()); err != nil {
		return nil, err
	}
	step.Vacuum = time.Since(start).Seconds()
	size, err := tableSize(ctx, db)
	if err != nil {
		return nil, err
	}
	step.Size = *size
	o.logf("  +%d rows in %.1f s (vacuum %.1f s): %.0f bytes/row, primary key %.0f bytes/row",
		step.Added, step.Seconds, step.Vacuum, size.BytesPerRow(), float64(size.PKBytes)/float64(max(1, size.Rows)))
	return step, nil
}

// fillRange inserts rows from+1..to of total in chunks, on as many connections as
// there are CPUs: the md5, the SHA-256 and the index insertions are CPU
// work a single backend does on one core.
func fillRange(ctx context.Context, db *pgxpool.Pool, from, to, total int64) error {
	chunks := make(chan int64)
	errs := make(chan error, runtime.NumCPU())
	for range runtime.NumCPU() {
		go func() {
			var failed error
			for lo := range chunks {
				if failed != nil {
					continue // drain, so that the sender does not block
				}
				if _, err := db.Exec(ctx, fillSQL, lo, min(lo+fillChunk-1, to), total); err != nil {
					failed = fmt.Errorf("fill: %w", err)
				}
			}
			errs <- failed
		}()
	}
	for lo := from + 1; lo <= to; lo += fillChunk {
		chunks <- lo
	}
	close(chunks)
	var first error
	for range runtime.NumCPU() {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return first
}

// tableSize counts processed_events' rows exactly and reads its sizes.
func tableSize(ctx context.Context, db *pgxpool.Pool) (*TableSize, error) {
	t := pgx.Identifier{scaleSchema, "processed_events"}.Sanitize()
	pk := pgx.Identifier{scaleSchema, "processed_events_pkey"}.Sanitize()
	var s TableSize
	err := db.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+t+`), pg_table_size('`+t+`'), pg_relation_size('`+pk+`'),
pg_indexes_size('`+t+`'), coalesce((SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = '`+t+`'::regclass), 0)`).
		Scan(&s.Rows, &s.HeapBytes, &s.PKBytes, &s.IndexBytes, &s.DeadTuples)
	return &s, err
}

// vsEmpty fills each point's ratio to the same row's on the smallest
// table.
func vsEmpty(points []ScalePoint) {
	first := map[Row]float64{}
	for _, p := range points {
		if _, ok := first[p.Row]; !ok {
			first[p.Row] = p.Rate
		}
	}
	for i := range points {
		if f := first[points[i].Row]; f > 0 {
			points[i].VsEmpty = points[i].Rate / f
		}
	}
}

// postgresSettings reads the settings that decide how a big table
// behaves.
func postgresSettings(ctx context.Context, db *pgxpool.Pool) (map[string]string, error) {
	names := []string{"shared_buffers", "effective_cache_size", "work_mem", "maintenance_work_mem", "fsync",
		"synchronous_commit", "full_page_writes", "wal_level", "max_wal_size", "checkpoint_timeout", "autovacuum",
		"autovacuum_naptime", "autovacuum_vacuum_scale_factor", "autovacuum_vacuum_threshold",
		"autovacuum_vacuum_insert_scale_factor", "autovacuum_vacuum_cost_delay", "autovacuum_vacuum_cost_limit",
		"autovacuum_max_workers", "max_connections"}
	rows, err := db.Query(ctx, `SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY($1)`, names)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	var name, value string
	_, err = pgx.ForEachRow(rows, []any{&name, &value}, func() error {
		out[name] = value
		return nil
	})
	return out, err
}

// explainClaims captures EXPLAIN (ANALYZE, BUFFERS) of a 100-id claim, 90
// new ids and 10 the fill left, by the library (dedup.Store.ClaimBatch)
// and by the hand-written row's statement, each in a transaction rolled
// back. auto_explain sends each plan as a NOTICE, so the library's own
// statement is explained without copying its SQL here.
func explainClaims(ctx context.Context, url string, store *dedup.Store, plans map[string]string) error {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return err
	}
	var mu sync.Mutex
	var notices []string
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		notices = append(notices, n.Message)
		mu.Unlock()
	}
	cfg.RuntimeParams["search_path"] = scaleSchema
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	for _, s := range []string{`LOAD 'auto_explain'`, `SET auto_explain.log_min_duration = 0`, `SET auto_explain.log_analyze = on`,
		`SET auto_explain.log_buffers = on`, `SET auto_explain.log_level = notice`, `SET client_min_messages = notice`} {
		if _, err := conn.Exec(ctx, s); err != nil {
			return fmt.Errorf("%s: %w", s, err)
		}
	}
	ids := explainIDs()
	last := func() string {
		mu.Lock()
		defer mu.Unlock()
		for i := len(notices) - 1; i >= 0; i-- {
			if strings.Contains(notices[i], "unnest") {
				return notices[i]
			}
		}
		return ""
	}
	claims := make([]dedup.Claim, len(ids))
	for i, id := range ids {
		claims[i] = dedup.Claim{Consumer: "bench", EventID: id, Fingerprint: make([]byte, 32), Source: "explain", Partition: 0, Offset: int64(i)}
	}
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := store.ClaimBatch(ctx, tx, claims); err != nil {
			return err
		}
		return errRollback
	})
	if !errors.Is(err, errRollback) {
		return err
	}
	plans["library batch claim"] = last()
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := claimHand(ctx, tx, ids); err != nil {
			return err
		}
		return errRollback
	})
	if !errors.Is(err, errRollback) {
		return err
	}
	plans["hand-written claim"] = last()
	return nil
}

var errRollback = errors.New("rolled back on purpose")

// explainIDs returns 90 ids the fill never made and 10 it made for the
// consumer "bench" (row numbers that are multiples of 10), shuffled.
func explainIDs() []string {
	var ids []string
	for i := range 90 {
		ids = append(ids, fmt.Sprintf("%016x-explain-%d", rand.Uint64(), i))
	}
	for i := range 10 {
		ids = append(ids, fmt.Sprintf("%x-f", md5.Sum([]byte(fmt.Sprint(10*(1+rand.IntN(100000))+10*i)))))
	}
	rand.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
	return ids
}

// loadAvg returns the 1-, 5- and 15-minute load averages.
func loadAvg() string {
	raw, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(raw))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}
