package bench

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Scale-out: a row run by several processes of one consumer name at once,
// in one Kafka consumer group or on one RabbitMQ queue, against one
// PostgreSQL (Options.Processes). Each process is a subprocess of the
// bench, as a single row's is. The processes share the backlog: each
// reports its acks to a progress table of the row's schema, and all stop
// once the acks add up to the backlog. The row's rate is the backlog over
// the time from the first delivery any process received to the moment the
// last one saw the total reached; each process's share is its acks.

// progressTable holds each process's acks while a scale-out row runs.
const progressTable = "scaleout_progress"

// createProgressTable creates the progress table in the row's schema.
func createProgressTable(ctx context.Context, db *pgxpool.Pool, schema string) error {
	_, err := db.Exec(ctx, `CREATE TABLE `+pgx.Identifier{schema, progressTable}.Sanitize()+` (process int PRIMARY KEY, acked bigint NOT NULL)`)
	return err
}

// runProcesses runs spec in n subprocesses at once and combines what they
// report: the messages and the time span of all of them, and each one's
// acks (shares). Each process is killed after deadline.
func runProcesses(ctx context.Context, spec *rowSpec, n int, deadline time.Duration) (*childResult, []int, error) {
	results := make([]*childResult, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		s := *spec
		s.Processes, s.Process = n, i
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = runSubprocess(ctx, &s, deadline)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			return nil, nil, fmt.Errorf("process %d of %d: %w", i+1, n, err)
		}
	}
	return combine(results, spec.Backlog)
}

// combine sums the processes' results into one row's.
func combine(results []*childResult, backlog int) (*childResult, []int, error) {
	var first, last int64
	shares := make([]int, len(results))
	out := &childResult{Messages: backlog}
	// Each process's figures weigh its share of all the acks, which
	// exceed the backlog when a rebalance redelivered some.
	acked := 0
	for _, r := range results {
		acked += r.Acked
	}
	for i, r := range results {
		shares[i] = r.Acked
		if r.FirstAtNs > 0 && (first == 0 || r.FirstAtNs < first) {
			first = r.FirstAtNs
		}
		last = max(last, r.DoneAtNs)
		out.RoundTrips += r.RoundTrips
		out.Commits += r.Commits
		w := float64(r.Acked) / float64(max(1, acked))
		out.AllocsPerMsg += r.AllocsPerMsg * w
		out.IdleShare += r.IdleShare * w
		out.RSSKB = max(out.RSSKB, r.RSSKB)
	}
	if first == 0 || last <= first {
		return nil, nil, fmt.Errorf("no process received anything")
	}
	out.Seconds = time.Duration(last - first).Seconds()
	out.Rate = float64(backlog) / out.Seconds
	return out, shares, nil
}

// awaitPeers registers this process of a scale-out row and blocks until
// every process has, so that they start consuming together: a process
// that started alone would take the whole backlog (a Kafka group's first
// member owns every partition until the next one joins).
func awaitPeers(ctx context.Context, spec *rowSpec) error {
	conn, err := progressConn(ctx, spec)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, `INSERT INTO `+progressTable+` (process, acked) VALUES ($1, 0)`, spec.Process); err != nil {
		return err
	}
	deadline := time.Now().Add(spec.Timeout)
	for {
		var joined int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM `+progressTable).Scan(&joined); err != nil {
			return err
		}
		if joined >= spec.Processes {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d processes started within %s", joined, spec.Processes, spec.Timeout)
		}
		select {
		case <-time.After(5 * time.Millisecond): // polling a condition, with the deadline above
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// progressConn opens a connection of its own to the row's schema.
func progressConn(ctx context.Context, spec *rowSpec) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(spec.DatabaseURL)
	if err != nil {
		return nil, err
	}
	cfg.RuntimeParams["search_path"] = spec.Schema
	return pgx.ConnectConfig(ctx, cfg)
}

// waitShared blocks until the acks of every process of a scale-out row
// add up to the backlog, reporting this process's acks every few
// milliseconds on a connection of its own (so that the row's wire counter
// sees only the consumer's traffic). It fails when the row stops or the
// timeout passes first.
func waitShared(ctx context.Context, spec *rowSpec, m *meter, finished <-chan struct{}) error {
	conn, err := progressConn(ctx, spec)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	deadline := time.NewTimer(spec.Timeout)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		var total int64
		err := conn.QueryRow(ctx, `WITH mine AS (
	INSERT INTO `+progressTable+` (process, acked) VALUES ($1, $2)
	ON CONFLICT (process) DO UPDATE SET acked = EXCLUDED.acked)
SELECT coalesce(sum(acked), 0) + $2 FROM `+progressTable+` WHERE process <> $1`, spec.Process, m.Acked()).Scan(&total)
		if err != nil {
			return err
		}
		if total >= int64(spec.Backlog) {
			return nil
		}
		select {
		case <-tick.C:
		case <-finished:
			return fmt.Errorf("the row stopped after %d acks of this process, %d of %d in all", m.Acked(), total, spec.Backlog)
		case <-deadline.C:
			return fmt.Errorf("%d of %d messages acked by all processes after %s", total, spec.Backlog, spec.Timeout)
		}
	}
}
