package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
)

// Projection is what a table of Rows rows would need, from the growth
// measured between the last two fill steps.
type Projection struct {
	Rows int64 `json:"rows"`
	// DiskBytes is the table and its indexes; PKBytes the primary key,
	// which should stay in memory (shared_buffers and the OS cache) since
	// claims of random ids touch any of its pages.
	DiskBytes int64 `json:"disk_bytes"`
	PKBytes   int64 `json:"pk_bytes"`
	// FillSeconds is how long inserting that many rows took here, at the
	// fill's rate; RetentionSeconds how long expiring half of them would
	// take at the retention phase's rate.
	FillSeconds      float64 `json:"fill_seconds"`
	RetentionSeconds float64 `json:"retention_seconds"`
}

// Project extrapolates the last fill step's growth to rows.
func (r *ScaleReport) Project(rows int64) *Projection {
	if len(r.Fill) == 0 {
		return nil
	}
	last := r.Fill[len(r.Fill)-1]
	var prev TableSize
	if len(r.Fill) > 1 {
		prev = r.Fill[len(r.Fill)-2].Size
	}
	dRows := float64(last.Size.Rows - prev.Rows)
	if dRows <= 0 {
		return nil
	}
	perRow := float64(last.Size.HeapBytes+last.Size.IndexBytes-prev.HeapBytes-prev.IndexBytes) / dRows
	pkPerRow := float64(last.Size.PKBytes-prev.PKBytes) / dRows
	p := &Projection{Rows: rows, DiskBytes: int64(perRow * float64(rows)), PKBytes: int64(pkPerRow * float64(rows)),
		FillSeconds: (last.Seconds + last.Vacuum) / float64(last.Added) * float64(rows)}
	if ret := r.Retention; ret != nil && ret.DeletedPerSecond > 0 {
		p.RetentionSeconds = float64(rows) / 2 / ret.DeletedPerSecond
	}
	return p
}

func mb(b int64) float64 { return float64(b) / (1 << 20) }

// WriteTable writes the scale report: machine and settings, the fill, the
// rows at each table size, the plans, retention and the projection.
func (r *ScaleReport) WriteTable(w io.Writer) error {
	m := r.Machine
	pg := m.Postgres
	if i := strings.Index(pg, " on "); i > 0 {
		pg = pg[:i]
	}
	fmt.Fprintf(w, "machine: %d CPUs, %d MB; %s; %s\n", m.CPUs, m.MemoryMB, pg, m.Go)
	var keys []string
	for k := range r.Settings {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var kv []string
	for _, k := range keys {
		kv = append(kv, k+"="+r.Settings[k])
	}
	fmt.Fprintf(w, "postgres: %s\n", strings.Join(kv, ", "))
	c := r.Workload.Counts()
	fmt.Fprintf(w, "workload per run: Kafka, %d events, %d messages (every %dth twice, every %dth poison), %d partitions, ids hashed over the key\n\n",
		r.Workload.Events, c.Messages, r.Workload.DupEvery, r.Workload.PoisonEvery, r.Workload.Partitions)

	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', tabwriter.AlignRight|tabwriter.Debug)
	fmt.Fprintln(tw, "fill to rows\t added\t insert s\t vacuum s\t heap MB\t indexes MB\t primary key MB\t bytes/row\t pk bytes/row\t")
	for _, f := range r.Fill {
		s := f.Size
		fmt.Fprintf(tw, "%d\t %d\t %.1f\t %.1f\t %.0f\t %.0f\t %.0f\t %.1f\t %.1f\t\n", s.Rows, f.Added, f.Seconds, f.Vacuum,
			mb(s.HeapBytes), mb(s.IndexBytes), mb(s.PKBytes), s.BytesPerRow(), float64(s.PKBytes)/float64(max(1, s.Rows)))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	fmt.Fprintln(tw, "table rows\t row\t msgs/s\t x empty table\t load (1/5/15 min)\t correct\t")
	for _, p := range r.Points {
		fmt.Fprintf(tw, "%d\t %s\t %.0f\t %.2f\t %s\t %s (%s)\t\n", p.TableRows, p.Row, p.Rate, p.VsEmpty, p.Load, yesNo(p.Correct), p.Check)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, name := range []string{"library batch claim", "hand-written claim"} {
		if plan := r.Plans[name]; plan != "" {
			fmt.Fprintf(w, "\n%s on the full table, 100 ids (90 new), EXPLAIN (ANALYZE, BUFFERS) by auto_explain:\n%s\n", name, plan)
		}
	}
	if ret := r.Retention; ret != nil {
		fmt.Fprintf(w, "\nretention while consuming (%s, %d messages, dedup.Store.DeleteOlderThan per consumer, cutoff 7 days, batch %d, duty cycle %.2f):\n", ret.Row, ret.Messages, ret.Batch, ret.Duty)
		fmt.Fprintf(tw, "msgs/s without\t msgs/s during\t ratio\t deleted\t during the row\t retention s\t deleted/s\t overlap\t lock-wait samples\t max waiters\t load\t correct\t\n")
		fmt.Fprintf(tw, "%.0f\t %.0f\t %.2f\t %d\t %d\t %.1f\t %.0f\t %.0f%%\t %d/%d\t %d\t %s\t %s\t\n", ret.RateWithout, ret.RateDuring, ret.Ratio,
			ret.Deleted, ret.DeletedDuringRow, ret.RetentionSeconds, ret.DeletedPerSecond, 100*ret.Overlap, ret.LockWaitSamples, ret.Samples,
			ret.MaxLockWaiters, ret.Load, yesNo(ret.Correct))
		if err := tw.Flush(); err != nil {
			return err
		}
		fmt.Fprintf(w, "retention statements: %d, p50 %.1f ms, max %.1f ms\n", ret.Statements, ret.StatementP50Ms, ret.StatementMaxMs)
		if plan := r.Plans["slowest retention statement"]; plan != "" {
			fmt.Fprintf(w, "slowest retention statement (auto_explain, over 250 ms):\n%s\n", plan)
		}
		fmt.Fprintf(w, "lock waits by wait event (sessions over all samples): %v\n", ret.LockWaitEvents)
		fmt.Fprintf(w, "correct: %s\n", ret.Check)
		fmt.Fprintln(w)
		fmt.Fprintln(tw, "table\t rows\t heap MB\t indexes MB\t dead tuples\t")
		for _, s := range []struct {
			name string
			t    TableSize
		}{{"before retention", ret.Before}, {"right after", ret.After}, {fmt.Sprintf("after VACUUM (%.1f s)", ret.VacuumSeconds), ret.AfterVacuum}} {
			fmt.Fprintf(tw, "%s\t %d\t %.0f\t %.0f\t %d\t\n", s.name, s.t.Rows, mb(s.t.HeapBytes), mb(s.t.IndexBytes), s.t.DeadTuples)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		fmt.Fprintf(w, "autovacuum runs on processed_events so far: %d\n", ret.AutovacuumRuns)
		if k := ret.Keyset; k != nil {
			fmt.Fprintf(w, "then the proposed keyset retention statement (keyset.go), rows older than %s, after the VACUUM: %.0f msgs/s during (%.2fx of without), %d rows deleted in %.1f s (%.0f/s, %d during the row), %d statements p50 %.1f ms max %.1f ms, lock waits in %d of %d samples, load %s, correct: %s (%s)\n",
				k.Cutoff, k.RateDuring, k.Ratio, k.Deleted, k.Seconds, k.DeletedPerSecond, k.DeletedDuringRow, k.Statements, k.StatementP50Ms, k.StatementMaxMs,
				k.LockWaitSamples, k.Samples, k.Load, yesNo(k.Correct), k.Check)
		}
	}
	if p := r.Project(100_000_000); p != nil {
		fmt.Fprintf(w, "\n100M rows, from the growth of the last fill step: %.1f GB of table and indexes, of which the primary key %.1f GB (keep it in memory); filling took %.0f s per 100M here; expiring half of them would take %.0f s at the measured deletion rate\n",
			float64(p.DiskBytes)/(1<<30), float64(p.PKBytes)/(1<<30), p.FillSeconds, p.RetentionSeconds)
	}
	fmt.Fprintf(w, "whole run: %.0f s\n", r.Seconds)
	return nil
}

func yesNo(ok bool) string {
	if ok {
		return "yes"
	}
	return "NO"
}

// Correct reports whether every run's effects were exactly right.
func (r *ScaleReport) Correct() bool {
	for _, p := range r.Points {
		if !p.Correct {
			return false
		}
	}
	return r.Retention == nil || r.Retention.Correct
}

// WriteJSON writes the report, with the 100M projection, as indented JSON.
func (r *ScaleReport) WriteJSON(path string) error {
	raw, err := json.MarshalIndent(struct {
		*ScaleReport
		Projection *Projection `json:"projection_100m"`
	}{r, r.Project(100_000_000)}, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(raw, '\n'), 0o644)
}

// WritePNG plots msgs/s against table size, a line per row.
func (r *ScaleReport) WritePNG(path string) error {
	var series []Series
	for _, p := range r.Points {
		i := slices.IndexFunc(series, func(s Series) bool { return s.Name == string(p.Row) })
		if i < 0 {
			series = append(series, Series{Name: string(p.Row)})
			i = len(series) - 1
		}
		series[i].X = append(series[i].X, float64(p.TableRows)/1e6)
		series[i].Y = append(series[i].Y, p.Rate)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := Plot(f, "msgs/s against processed_events rows (millions)", series); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
