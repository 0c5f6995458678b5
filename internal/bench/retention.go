package bench

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/dedup"
)

// retentionPhase runs the library's best row on the full table twice with
// the same backlog: once alone, once while dedup's retention deletes
// every consumer's rows older than retentionAge (the consumer's own
// first), and samples lock waits while retention runs.
func retentionPhase(ctx context.Context, db *pgxpool.Pool, kc *kafkaCluster, store *dedup.Store, ro Options, o *ScaleOptions, rep *ScaleReport) (*RetentionResult, error) {
	row := bestScaleRow(rep.Points)
	ro.Workload.Events = o.RetentionEvents
	before, err := tableSize(ctx, db)
	if err != nil {
		return nil, err
	}
	r := &RetentionResult{Row: row, Batch: o.RetentionBatch, Duty: o.RetentionDuty, Before: *before}
	o.logf("retention: %s, %d events, without retention", row, o.RetentionEvents)
	without, err := runRow(ctx, db, kc, ro, Kafka, row)
	if err != nil {
		return nil, err
	}
	r.RateWithout = without.Rate

	o.logf("retention: %s, %d events, while deleting rows older than %s", row, o.RetentionEvents, retentionAge)
	ro.scale.idPrefix += "r-"
	var deleted atomic.Int64
	var wg sync.WaitGroup
	retCtx, stopSampling := context.WithCancel(ctx)
	defer stopSampling()
	slow := &slowestPlan{}
	retDB, err := explainingPool(ctx, ro.DatabaseURL, slow)
	if err != nil {
		return nil, err
	}
	defer retDB.Close()
	var retErr error
	var retEnd time.Time
	var took []time.Duration
	retStart := time.Now()
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer stopSampling()
		retErr = expireAll(ctx, retDB, store, time.Now().Add(-retentionAge), o.RetentionBatch, o.RetentionDuty, &deleted, &took)
		retEnd = time.Now()
	}()
	samples := make(chan lockSamples, 1)
	go func() { samples <- sampleLockWaits(retCtx, db) }()

	during, err := runRow(ctx, db, kc, ro, Kafka, row)
	rowEnd := time.Now()
	r.DeletedDuringRow = deleted.Load()
	wg.Wait()
	if err != nil {
		return nil, err
	}
	if retErr != nil {
		return nil, retErr
	}
	ls := <-samples
	r.Messages, r.RateDuring, r.Correct = during.Messages, during.Rate, without.Correct && during.Correct
	r.Check = "without: " + without.Check + "; during: " + during.Check
	r.Ratio = r.RateDuring / r.RateWithout
	r.RowSeconds = during.Seconds
	r.RetentionSeconds = retEnd.Sub(retStart).Seconds()
	// The share of the row (from the start of retention to when runRow
	// returned, which includes the subprocess's start) that retention ran.
	r.Overlap = min(1, retEnd.Sub(retStart).Seconds()/max(rowEnd.Sub(retStart).Seconds(), 1e-9))
	r.Deleted = deleted.Load()
	r.DeletedPerSecond = float64(r.Deleted) / r.RetentionSeconds
	r.Samples, r.LockWaitSamples, r.MaxLockWaiters, r.LockWaitEvents = ls.samples, ls.waiting, ls.max, ls.events
	r.Load = loadAvg()
	rep.Plans["slowest retention statement"] = slow.plan
	r.Statements = len(took)
	slices.Sort(took)
	r.StatementP50Ms, r.StatementMaxMs = ms(percentile(took, 0.5)), ms(percentile(took, 1))
	o.logf("  %.0f msgs/s without, %.0f during (%.2fx); %d rows deleted in %.1f s; lock waits in %d of %d samples",
		r.RateWithout, r.RateDuring, r.Ratio, r.Deleted, r.RetentionSeconds, r.LockWaitSamples, r.Samples)

	after, err := tableSize(ctx, db)
	if err != nil {
		return nil, err
	}
	r.After = *after
	t := pgx.Identifier{scaleSchema, "processed_events"}.Sanitize()
	if err := db.QueryRow(ctx, `SELECT autovacuum_count FROM pg_stat_user_tables WHERE relid = '`+t+`'::regclass`).Scan(&r.AutovacuumRuns); err != nil {
		return nil, err
	}
	start := time.Now()
	if _, err := db.Exec(ctx, `VACUUM `+t); err != nil {
		return nil, err
	}
	r.VacuumSeconds = time.Since(start).Seconds()
	if after, err = tableSize(ctx, db); err != nil {
		return nil, err
	}
	r.AfterVacuum = *after

	o.logf("retention: %s, %d events, while the proposed keyset statement deletes rows older than %s", row, o.RetentionEvents, retentionAge/2)
	if r.Keyset, err = keysetSweep(ctx, db, kc, ro, row, retentionAge/2, o.RetentionBatch, r.RateWithout); err != nil {
		return nil, err
	}
	k := r.Keyset
	r.Correct = r.Correct && k.Correct
	o.logf("  %.0f msgs/s during (%.2fx of without); %d rows deleted in %.1f s; statements p50 %.1f ms, max %.1f ms",
		k.RateDuring, k.Ratio, k.Deleted, k.Seconds, k.StatementP50Ms, k.StatementMaxMs)
	return r, nil
}

// bestScaleRow is the library row with the highest rate on the largest
// table measured.
func bestScaleRow(points []ScalePoint) Row {
	var best ScalePoint
	for _, p := range points {
		if p.Row == RowHandwritten {
			continue
		}
		if p.TableRows > best.TableRows || (p.TableRows == best.TableRows && p.Rate > best.Rate) {
			best = p
		}
	}
	if best.Row == "" {
		return RowOnceBatchHandler
	}
	return best.Row
}

// expireAll runs dedup's retention for every consumer of the table, the
// bench consumer's first, adding what each of its statements deleted to
// deleted as it goes.
func expireAll(ctx context.Context, db *pgxpool.Pool, store *dedup.Store, cutoff time.Time, batch int, duty float64, deleted *atomic.Int64, took *[]time.Duration) error {
	counting := countingDB{Pool: db, deleted: deleted, mu: &sync.Mutex{}, took: took}
	for _, c := range scaleConsumers {
		if _, err := store.DeleteOlderThan(ctx, counting, c, cutoff, batch, dedup.DutyCycle(duty)); err != nil {
			return fmt.Errorf("%s: %w", c, err)
		}
	}
	return nil
}

// countingDB adds the rows each Exec affected to deleted, retention's
// progress while it runs, and keeps each statement's duration.
type countingDB struct {
	*pgxpool.Pool
	deleted *atomic.Int64
	mu      *sync.Mutex
	took    *[]time.Duration
}

// Exec implements dedup.DB.
func (c countingDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	start := time.Now()
	tag, err := c.Pool.Exec(ctx, sql, args...)
	c.deleted.Add(tag.RowsAffected())
	c.mu.Lock()
	*c.took = append(*c.took, time.Since(start))
	c.mu.Unlock()
	return tag, err
}

// QueryRow implements dedup.DB: the retention statement of
// processed_events returns the rows it deleted as its first column.
func (c countingDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	start := time.Now() // the statement runs before QueryRow returns
	return countedRow{Row: c.Pool.QueryRow(ctx, sql, args...), c: c, start: start}
}

// countedRow adds a retention statement's deleted rows (its first column)
// to deleted once scanned, and keeps the statement's duration.
type countedRow struct {
	pgx.Row
	c     countingDB
	start time.Time
}

func (r countedRow) Scan(dest ...any) error {
	err := r.Row.Scan(dest...)
	if n, ok := dest[0].(*int64); ok && err == nil {
		r.c.deleted.Add(*n)
	}
	r.c.mu.Lock()
	*r.c.took = append(*r.c.took, time.Since(r.start))
	r.c.mu.Unlock()
	return err
}

type lockSamples struct {
	samples, waiting, max int
	// events counts, by wait event (relation, tuple, transactionid,
	// extend, ...), the waiting sessions seen over all samples.
	events map[string]int
}

// sampleLockWaits counts, every 100 ms until ctx ends, the sessions
// waiting for a lock, and for which kind of lock.
func sampleLockWaits(ctx context.Context, db *pgxpool.Pool) lockSamples {
	s := lockSamples{events: map[string]int{}}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return s
		case <-tick.C:
		}
		var events []string
		err := db.QueryRow(ctx, `SELECT coalesce(array_agg(wait_event), '{}') FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND datname = current_database()`).Scan(&events)
		if err != nil {
			continue
		}
		s.samples++
		if len(events) > 0 {
			s.waiting++
		}
		s.max = max(s.max, len(events))
		for _, e := range events {
			s.events[e]++
		}
	}
}

// slowestPlan keeps the plan of the slowest statement auto_explain
// reported.
type slowestPlan struct {
	mu   sync.Mutex
	ms   float64
	plan string
}

func (s *slowestPlan) notice(_ *pgconn.PgConn, n *pgconn.Notice) {
	var ms float64
	if _, err := fmt.Sscanf(n.Message, "duration: %f ms", &ms); err != nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if ms > s.ms {
		s.ms, s.plan = ms, n.Message
	}
}

// explainingPool is a pool whose sessions send, through auto_explain, the
// plan (with buffers, without per-node timing) of every statement slower
// than 250 ms to slow. Without the right to LOAD auto_explain (not a
// superuser), it is a plain pool.
func explainingPool(ctx context.Context, url string, slow *slowestPlan) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 2
	cfg.ConnConfig.OnNotice = slow.notice
	cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, `LOAD 'auto_explain'`)
		if err != nil {
			return nil // best effort
		}
		for _, set := range []string{`SET auto_explain.log_min_duration = 250`, `SET auto_explain.log_analyze = on`,
			`SET auto_explain.log_timing = off`, `SET auto_explain.log_buffers = on`, `SET auto_explain.log_level = notice`} {
			if _, err := conn.Exec(ctx, set); err != nil {
				return err
			}
		}
		return nil
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}
