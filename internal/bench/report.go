package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
)

// WriteTable writes the report as a Markdown table with a header saying
// what was measured where.
func (r *Report) WriteTable(w io.Writer) error {
	m := r.Machine
	pg := m.Postgres
	if i := strings.Index(pg, " on "); i > 0 {
		pg = pg[:i]
	}
	where := "DATABASE_URL"
	if m.Throwaway {
		where = "throwaway server"
	}
	fmt.Fprintf(w, "machine: %d CPUs, %d MB; %s (%s, fsync=%s, synchronous_commit=%s); %s\n",
		m.CPUs, m.MemoryMB, pg, where, m.Fsync, m.SynchronousCommit, m.Go)
	wl := r.Workload
	c := wl.Counts()
	fmt.Fprintf(w, "workload per row: %d events, %d messages (every %dth event twice, every %dth poison), ~200-byte payloads, %d partitions\n",
		wl.Events, c.Messages, wl.DupEvery, wl.PoisonEvery, wl.Partitions)
	if dirs := r.dataDirs(); dirs != "" {
		fmt.Fprintln(w, "files:", dirs)
	}
	if ww := m.WAL; ww != nil {
		fmt.Fprintf(w, "PostgreSQL WAL: %d segments of %d MB made and recycled before the rows, %d ready ahead (a fresh cluster creates and zero-fills each new segment while commits wait; one that has run a while recycles them)\n",
			ww.Made, ww.SegmentMB, ww.Ready)
	}
	if r.AMQPLazy {
		fmt.Fprintln(w, "RabbitMQ queues: lazy (x-queue-mode; -amqp-lazy)")
	}
	if r.PGBench > 0 {
		fmt.Fprintf(w, "ceiling 2 (database alone): %.0f rows/s (%.0f tps): %s\n", r.PGBench, r.PGBenchTPS, r.PGBenchArgs)
	}
	if r.PaceSeconds > 0 {
		fmt.Fprintf(w, "latency: produce to ack, over a paced phase of %gs per row at half the row's msgs/s (at most %.0f; achieved: \"at msgs/s\"), the first sixth excluded as warm-up\n",
			r.PaceSeconds, r.PaceMax)
	}
	fmt.Fprintln(w, "msgs/s, allocs/msg, peak RSS: the backlog phase, in the row's own subprocess (VmHWM)")
	fmt.Fprintf(w, "idle %%: the share of the backlog phase (sampled every %s) in which the row held no delivery, all it had received acked: waiting for the broker\n", idleSampleEvery)
	if m.Throwaway && r.PaceSeconds > 0 {
		fmt.Fprintf(w, "disk sync max: the longest 8 KiB write + fdatasync beside the server's data, one every %s, over the same part of the paced phase\n", syncProbeEvery)
	}
	if r.PaceSeconds > 0 {
		fmt.Fprintf(w, "wake lag max: the latest a goroutine of the row's process that sleeps %s woke, same part of the paced phase (time waiting for a core)\n", lagProbeEvery)
	}
	if n := len(r.runNumbers()); n > 1 {
		fmt.Fprintf(w, "runs: %d of each broker's rows, one after the other; ratios compare rows of the same run, targets give each run's value in order\n", n)
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', tabwriter.AlignRight|tabwriter.Debug)
	runs := len(r.runNumbers()) > 1
	if runs {
		fmt.Fprint(tw, "run\t ")
	}
	fmt.Fprintln(tw, "broker\t row\t msgs/s\t idle %\t p50 ms\t p99 ms\t p99 to Receive ms\t at msgs/s\t disk sync max ms\t wake lag max ms\t allocs/msg\t peak RSS MB\t msgs/tx\t round trips/tx\t x naive\t x lower ceiling\t x hand-written\t correct\t")
	if runs {
		fmt.Fprint(tw, "---\t ")
	}
	fmt.Fprintln(tw, "---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t ---\t")
	marked := false
	for _, x := range r.Results {
		verdict := "yes"
		if !x.Correct {
			verdict = "NO"
		}
		check := x.Check
		if x.Error != "" {
			// A failed row shows why; its figures are "-" when it
			// measured none.
			verdict, check = "FAILED", strings.TrimPrefix(check+"; "+x.Error, "; ")
			if x.Messages == 0 {
				if runs {
					fmt.Fprintf(tw, "%d\t ", x.Run)
				}
				fmt.Fprintf(tw, "%s\t %s\t%s %s (%s)\t\n", x.Broker, x.Row, strings.Repeat(" -\t", 15), verdict, check)
				continue
			}
		}
		if runs {
			fmt.Fprintf(tw, "%d\t ", x.Run)
		}
		// The ceiling acks each delivery as it receives it: it holds
		// none nearly all the time, which says nothing about its broker.
		idle := fmt.Sprintf("%.0f", x.IdlePct)
		if x.Row == RowCeiling {
			idle = "-"
		}
		// A figure not measured (no paced phase, no probe, no row to
		// compare with) is "-", not a 0 that reads as one.
		paced := func(v float64, format string) string {
			if x.PacedMsgs == 0 {
				return "-"
			}
			return fmt.Sprintf(format, v)
		}
		fmt.Fprintf(tw, "%s\t %s\t %.0f\t %s\t %s\t %s\t %s\t %s\t %s\t %s\t %.1f\t %.1f\t %.1f\t %.2f\t %s\t %s\t %s\t %s (%s)\t\n",
			x.Broker, x.Row, x.Rate, idle, paced(x.P50Ms, "%.1f"), paced(x.P99Ms, "%.1f"), paced(x.ReceiveP99Ms, "%.1f"), paced(x.PacedRate, "%.0f"),
			orDash(x.DiskSyncMaxMs, "%.1f"), orDash(x.WakeLagMaxMs, "%.1f"), x.AllocsPerMsg, x.PeakRSSMB, x.MsgsPerTx, x.RoundTripsPerTx,
			x.ratioCell(x.VsNaive, RowNaive), x.ratioCell(x.VsCeiling, RowCeiling), x.ratioCell(x.VsHandwritten, RowHandwritten), verdict, check)
		marked = marked || len(x.RatioRowsWrong) > 0
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if marked {
		fmt.Fprintln(w, "\n*: against a row of the same run whose effects were wrong or that failed: no target is judged on it")
	}
	if err := r.HTTP.writeTable(w); err != nil {
		return err
	}
	if err := writeOutboxTable(w, r.Outbox); err != nil {
		return err
	}
	fmt.Fprintln(w)
	for _, t := range r.Targets() {
		fmt.Fprintln(w, t)
	}
	return nil
}

// ratioCell formats the ratio v against row for the table: "-" when not
// measured, marked "*" when that row's effects were wrong or it failed.
func (x *Result) ratioCell(v float64, row Row) string {
	s := orDash(v, "%.2f")
	if x.ratioRowWrong(row) {
		s += "*"
	}
	return s
}

// orDash formats v, or gives "-" for 0: a figure that was not measured.
func orDash(v float64, format string) string {
	if v == 0 {
		return "-"
	}
	return fmt.Sprintf(format, v)
}

// WriteJSON writes the report as indented JSON to path, with the target
// lines (Targets, met and not met) under "targets".
func (r *Report) WriteJSON(path string) error {
	raw, err := json.MarshalIndent(struct {
		*Report
		Targets []string `json:"targets"`
	}{r, r.Targets()}, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(raw, '\n'), 0o644)
}

// BestOnce returns the library's fastest batched row on broker b, or nil.
func (r *Report) BestOnce(b Broker) *Result {
	var best *Result
	for i := range r.Results {
		x := &r.Results[i]
		if x.Broker != b || x.Row == RowOncePerMessage || !strings.HasPrefix(string(x.Row), "once ") {
			continue
		}
		if best == nil || x.Rate > best.Rate {
			best = x
		}
	}
	return best
}

// dataDirs says where the throwaway servers kept their files: a database
// and a broker on one disk share its stalls, which separate hosts would
// not.
func (r *Report) dataDirs() string {
	var parts []string
	for _, d := range []struct{ name, dir string }{{"PostgreSQL", r.PostgresDir}, {"Apache Kafka", r.KafkaDir}, {"RabbitMQ", r.RabbitMQDir}} {
		if d.dir != "" {
			parts = append(parts, d.name+" "+d.dir)
		}
	}
	return strings.Join(parts, "; ")
}
