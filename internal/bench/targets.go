package bench

import (
	"fmt"
	"slices"
	"strings"
)

// sourceCeilingShare is the share of its broker's consume-and-ack ceiling
// (the ceiling row of the same run) the library's best row must reach.
const sourceCeilingShare = 0.7

// shortTailMs is the produce-to-ack p99 every library row must stay under
// at half its measured rate.
const shortTailMs = 25

// shortTailRuns is how many runs in a row the tail target asks to be met
// in.
const shortTailRuns = 3

// A target is one of the performance targets stated against one run.
type target struct {
	name  string // what is asked
	value string // what the run measured
	met   bool
	// runs is how many runs in a row the target asks for (1: one).
	runs int
}

func (t target) String() string { return fmt.Sprintf("%s: %s, %s", t.name, t.value, verdict(t.met)) }

// of judges t on a row whose effects were right or not: a row that left
// them wrong meets no target, its rate and tail being those of work not
// done right (a lost write is work saved).
func (t target) of(correct bool) target {
	if !correct {
		t.value += effectsWrong
		t.met = false
	}
	return t
}

// against judges t, stated on x, on a ratio against row of the same broker
// and run in r: when that row's effects were wrong, or it failed, the
// ratio compares with work not done right (or not measured), and t is not
// judged.
func (t target) against(r *Report, x *Result, row Row) target {
	if !x.ratioRowWrong(row) {
		return t
	}
	t.met = false
	for _, o := range r.Results {
		if o.Broker == x.Broker && o.Run == x.Run && o.Row == row && o.Error != "" {
			t.value += fmt.Sprintf(" (not judged: the %s row failed)", row)
			return t
		}
	}
	t.value += fmt.Sprintf(" (not judged: the %s row's effects were wrong)", row)
	return t
}

// ratioValue formats a ratio for a target's value: "-" when it was not
// measured.
func ratioValue(v float64, format string) string {
	if v == 0 {
		return "-"
	}
	return fmt.Sprintf(format, v)
}

// ofRow judges t on row x: a row that failed meets no target, and says
// so; one whose effects were wrong, as of says.
func (t target) ofRow(x *Result) target {
	if x.Error != "" {
		t.value += " (row failed)"
		t.met = false
		return t
	}
	return t.of(x.Correct)
}

// effectsWrong follows the value of a target judged on a row whose
// effects were wrong.
const effectsWrong = " (effects wrong)"

// Targets states the performance targets against the report. With one
// run, a line per target; with several (Options.Runs), a line per target
// with each run's value, in order, met only when met in every run: the
// issue asks some targets of three runs in a row, and a ratio that one run
// meets and the next misses is noise, not a result. A target asked of
// more runs in a row than the report holds (the tail's, shortTailRuns) is
// not met, whatever its values, and says so.
//
// A target resting on a ratio against a naive, ceiling or hand-written
// row whose effects were wrong, or that failed, is not judged: NOT met,
// saying why. A library row that failed is stated, NOT met, in each target
// it would have been judged on.
//
// In a diagnostic run without fsync (Report.PGNoFsync) no target is
// judged: commits there do not wait for the disk, so the figures show what
// the disk's stalls cost, not what the library does with its guarantees.
// A server named by DATABASE_URL is judged whatever its settings, which
// the report's first line states.
func (r *Report) Targets() []string {
	var out []string
	if r.PGNoFsync {
		out = append(out, "targets: not judged: PostgreSQL ran with fsync=off (a diagnostic run; the library's guarantees need fsync on)")
		return append(out, r.correctLine())
	}
	runs := r.runNumbers()
	per := make([][]target, len(runs))
	for i, n := range runs {
		per[i] = r.ofRun(n).runTargets()
	}
	if len(runs) == 1 {
		for _, t := range per[0] {
			if t.runs > 1 {
				t.value += fmt.Sprintf(" (1 run of the %d in a row asked)", t.runs)
				t.met = false
			}
			out = append(out, t.String())
		}
	} else {
		out = append(out, acrossRuns(per)...)
	}
	out = append(out, outboxTargets(r.Outbox)...)
	return append(out, r.correctLine())
}

// correctLine says whether every row's effects were exactly right: the
// consumer rows, the HTTP rows and the outbox rows.
func (r *Report) correctLine() string {
	correct := r.HTTP.Correct()
	for _, x := range r.Results {
		correct = correct && x.Correct
	}
	for _, x := range r.Outbox {
		correct = correct && x.Correct
	}
	return fmt.Sprintf("effects exactly right in every row: %s", map[bool]string{true: "yes", false: "NO"}[correct])
}

// acrossRuns joins each target's values over the runs, in the order the
// targets first appear. A target a run did not state (a row missing from
// it) counts as not met there.
func acrossRuns(per [][]target) []string {
	var names []string
	byName := map[string][]*target{}
	for i, ts := range per {
		for j := range ts {
			t := &ts[j]
			if _, ok := byName[t.name]; !ok {
				names = append(names, t.name)
				byName[t.name] = make([]*target, len(per))
			}
			byName[t.name][i] = t
		}
	}
	out := make([]string, 0, len(names))
	for _, name := range names {
		values := make([]string, len(per))
		met, asked := 0, 1
		for i, t := range byName[name] {
			values[i] = "-"
			if t != nil {
				values[i] = t.value
				if t.met {
					met++
				}
				asked = max(asked, t.runs)
			}
		}
		v := fmt.Sprintf("NOT met (in %d of %d runs)", met, len(per))
		if met == len(per) {
			v = fmt.Sprintf("met in all %d runs", len(per))
			if len(per) < asked {
				v += fmt.Sprintf(", NOT met: %d runs in a row asked", asked)
			}
		}
		out = append(out, fmt.Sprintf("%s: %s; %s", name, strings.Join(values, " | "), v))
	}
	return out
}

// runNumbers returns the runs the report holds, in order; a report of one
// run (Result.Run 0 or 1) has one.
func (r *Report) runNumbers() []int {
	var runs []int
	for _, x := range r.Results {
		if !slices.Contains(runs, x.Run) {
			runs = append(runs, x.Run)
		}
	}
	if len(runs) == 0 {
		runs = []int{0}
	}
	slices.Sort(runs)
	return runs
}

// ofRun returns a report of run n's rows alone.
func (r *Report) ofRun(n int) *Report {
	c := *r
	c.Results = nil
	for _, x := range r.Results {
		if x.Run == n {
			c.Results = append(c.Results, x)
		}
	}
	c.Outbox, c.HTTP = nil, nil
	return &c
}

// runTargets states the consumer rows' targets against a report of one
// run.
func (r *Report) runTargets() []target {
	var out []target
	for _, row := range []Row{RowOnceBatched, RowOnceQueued, RowOnceBatchHandler, RowOnceKeyLanes} {
		k := r.find(Kafka, row)
		if k == nil {
			continue
		}
		// A row that failed is stated in each target it would have been
		// judged on: against a naive row or a ceiling the run had, and on
		// its tail when the run had a paced phase.
		failed := k.Error != ""
		if k.VsNaive > 0 || k.ratioRowWrong(RowNaive) || failed && r.find(Kafka, RowNaive) != nil {
			out = append(out, target{fmt.Sprintf("target Kafka %s >= 10x naive", row), ratioValue(k.VsNaive, "%.1fx"), k.VsNaive >= 10, 1}.against(r, k, RowNaive).ofRow(k))
		}
		if k.VsCeiling > 0 || k.ratioRowWrong(RowCeiling) || failed && (r.find(Kafka, RowCeiling) != nil || r.PGBench > 0) {
			out = append(out, target{fmt.Sprintf("target Kafka %s >= 50%% of the lower ceiling", row), ratioValue(100*k.VsCeiling, "%.0f%%"), k.VsCeiling >= 0.5, 1}.against(r, k, RowCeiling).ofRow(k))
		}
		if k.PacedMsgs > 0 || failed && r.PaceSeconds > 0 {
			out = append(out, target{fmt.Sprintf("target Kafka %s p99 <= 50 ms at half its rate", row), pacedValue(k), k.P99Ms <= 50, 1}.ofRow(k))
		}
	}
	for _, row := range []Row{RowOnceBatched, RowOnceQueued, RowOnceBatchHandler} {
		if a := r.find(RabbitMQ, row); a != nil && (a.VsNaive > 0 || a.ratioRowWrong(RowNaive) || a.Error != "" && r.find(RabbitMQ, RowNaive) != nil) {
			out = append(out, target{fmt.Sprintf("target RabbitMQ %s >= 10x naive", row), ratioValue(a.VsNaive, "%.1fx"), a.VsNaive >= 10, 1}.against(r, a, RowNaive).ofRow(a))
		}
	}
	out = append(out, r.handwrittenTargets()...)
	return append(out, r.pipelineTargets()...)
}

// handwrittenTargets states, per broker, the library's best row as a ratio
// of the hand-written batched consumer: the issue asks for at least 1.0.
func (r *Report) handwrittenTargets() []target {
	var out []target
	for _, b := range []Broker{Kafka, ApacheKafka, RabbitMQ} {
		best := r.BestOnce(b)
		if best == nil || best.VsHandwritten == 0 && !best.ratioRowWrong(RowHandwritten) && (best.Error == "" || r.find(b, RowHandwritten) == nil) {
			continue
		}
		out = append(out, target{fmt.Sprintf("target %s best library row >= the hand-written batched row", b),
			fmt.Sprintf("%s (%s)", ratioValue(best.VsHandwritten, "%.2fx"), best.Row), best.VsHandwritten >= 1, 1}.against(r, best, RowHandwritten).ofRow(best))
	}
	return out
}

// pipelineTargets states the targets of the consumer pipeline against one
// run: on RabbitMQ, the best library row against the broker's own
// consume-and-ack ceiling, and on every broker, each library row's tail at
// half its rate.
func (r *Report) pipelineTargets() []target {
	var out []target
	if best, ceiling := r.BestOnce(RabbitMQ), r.find(RabbitMQ, RowCeiling); best != nil && ceiling != nil && (ceiling.Rate > 0 || !ceiling.Correct) {
		var share float64
		if ceiling.Rate > 0 {
			share = best.Rate / ceiling.Rate
		}
		t := target{fmt.Sprintf("target RabbitMQ best library row >= %.0f%% of the consume-and-ack ceiling", 100*sourceCeilingShare),
			fmt.Sprintf("%s (%s; ceiling %s msgs/s)", ratioValue(100*share, "%.0f%%"), best.Row, ratioValue(ceiling.Rate, "%.0f")), share >= sourceCeilingShare, 1}
		if !ceiling.Correct {
			reason := "row's effects were wrong"
			if ceiling.Error != "" {
				reason = "row failed"
			}
			t.value += fmt.Sprintf(" (not judged: the %s %s)", RowCeiling, reason)
			t.met = false
		}
		out = append(out, t.ofRow(best))
	}
	for _, x := range r.Results {
		if !strings.HasPrefix(string(x.Row), "once ") || x.PacedMsgs == 0 && (x.Error == "" || r.PaceSeconds == 0) {
			continue
		}
		value := pacedValue(&x)
		// Beside the tail, what the disk under the WAL and the cores did
		// meanwhile: a tail from every commit waiting on one slow flush, or
		// from the consumer waiting for a core, is not the library's.
		var env []string
		if x.DiskSyncMaxMs > 0 {
			env = append(env, fmt.Sprintf("disk sync max %.0f ms", x.DiskSyncMaxMs))
		}
		if x.WakeLagMaxMs > 0 {
			env = append(env, fmt.Sprintf("wake lag max %.0f ms", x.WakeLagMaxMs))
		}
		if len(env) > 0 {
			value += " (" + strings.Join(env, ", ") + ")"
		}
		out = append(out, target{fmt.Sprintf("target %s %s p99 <= %d ms at half its rate", x.Broker, x.Row, shortTailMs), value, x.P99Ms <= shortTailMs, shortTailRuns}.ofRow(&x))
	}
	return out
}

// pacedValue states x's tail for a target: "-" when it has none.
func pacedValue(x *Result) string {
	if x.PacedMsgs == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f ms at %.0f msgs/s", x.P99Ms, x.PacedRate)
}

// find returns the result of row on broker b, or nil.
func (r *Report) find(b Broker, row Row) *Result {
	for i := range r.Results {
		if r.Results[i].Broker == b && r.Results[i].Row == row {
			return &r.Results[i]
		}
	}
	return nil
}

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "NOT met"
}
