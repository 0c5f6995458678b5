package bench

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestPipelineTargets(t *testing.T) {
	r := &Report{Results: []Result{
		{Broker: RabbitMQ, Row: RowCeiling, Rate: 40000, PacedMsgs: 100, PacedRate: 20000, P99Ms: 90, Correct: true},
		{Broker: RabbitMQ, Row: RowHandwritten, Rate: 39000, PacedMsgs: 100, PacedRate: 19500, P99Ms: 90, Correct: true},
		{Broker: RabbitMQ, Row: RowOnceQueued, Rate: 20000, PacedMsgs: 100, PacedRate: 10000, P99Ms: 12, Correct: true},
		{Broker: RabbitMQ, Row: RowOnceBatchHandler, Rate: 30000, PacedMsgs: 100, PacedRate: 15000, P99Ms: 30, Correct: true},
		{Broker: Kafka, Row: RowOnceBatchHandler, Rate: 60000, Correct: true},
	}}
	var lines []string
	for _, x := range r.pipelineTargets() {
		lines = append(lines, x.String())
	}
	assert.Equal(t, []string{
		"target RabbitMQ best library row >= 70% of the consume-and-ack ceiling: 75% (once batch handler; ceiling 40000 msgs/s), met",
		"target rabbitmq once queued p99 <= 25 ms at half its rate: 12.0 ms at 10000 msgs/s, met",
		"target rabbitmq once batch handler p99 <= 25 ms at half its rate: 30.0 ms at 15000 msgs/s, NOT met",
	}, lines)
}

// Three runs in a row: each target is stated once, with every run's value
// in order, and met only when every run met it; ratios compare rows of the
// same run.
func TestTargetsAcrossRuns(t *testing.T) {
	r := &Report{}
	for run, rates := range [][2]float64{{40000, 42000}, {40000, 38000}, {30000, 36000}} {
		r.Results = append(r.Results,
			Result{Run: run + 1, Broker: RabbitMQ, Row: RowHandwritten, Rate: rates[0], Correct: true},
			Result{Run: run + 1, Broker: RabbitMQ, Row: RowOnceBatchHandler, Rate: rates[1], PacedMsgs: 100, PacedRate: rates[1] / 2, P99Ms: 20 + 2*float64(run), Correct: true})
	}
	ratios(r)
	assert.InDelta(t, 1.05, r.Results[1].VsHandwritten, 1e-9)
	assert.InDelta(t, 0.95, r.Results[3].VsHandwritten, 1e-9)
	assert.InDelta(t, 1.20, r.Results[5].VsHandwritten, 1e-9)
	assert.Equal(t, []string{
		"target rabbitmq best library row >= the hand-written batched row: 1.05x (once batch handler) | 0.95x (once batch handler) | 1.20x (once batch handler); NOT met (in 2 of 3 runs)",
		"target rabbitmq once batch handler p99 <= 25 ms at half its rate: 20.0 ms at 21000 msgs/s | 22.0 ms at 19000 msgs/s | 24.0 ms at 18000 msgs/s; met in all 3 runs",
		"effects exactly right in every row: yes",
	}, r.Targets())
}

// A row missing from one run (its broker failed there, say) is a target
// not met in that run, not one met in fewer runs.
func TestTargetMissingFromARunIsNotMet(t *testing.T) {
	per := [][]target{
		{{name: "target x", value: "1", met: true}},
		{},
	}
	assert.Equal(t, []string{"target x: 1 | -; NOT met (in 1 of 2 runs)"}, acrossRuns(per))
}

func TestCombineScaleOutProcesses(t *testing.T) {
	sec := int64(1_000_000_000)
	results := []*childResult{
		{Acked: 600, FirstAtNs: 10 * sec, DoneAtNs: 12 * sec, AllocsPerMsg: 40, RoundTrips: 30, Commits: 10, RSSKB: 100, IdleShare: 0.2},
		{Acked: 400, FirstAtNs: 11 * sec, DoneAtNs: 12*sec + sec/2, AllocsPerMsg: 50, RoundTrips: 20, Commits: 5, RSSKB: 300, IdleShare: 0.5},
		{Acked: 0, DoneAtNs: 12 * sec}, // received nothing
	}
	out, shares, err := combine(results, 1000)
	assert.NoError(t, err)
	assert.Equal(t, []int{600, 400, 0}, shares)
	assert.InDelta(t, 2.5, out.Seconds, 1e-9, "from the first delivery of any process to the last one done")
	assert.InDelta(t, 400, out.Rate, 1e-9)
	assert.InDelta(t, 44, out.AllocsPerMsg, 1e-9, "weighted by each process's share")
	assert.InDelta(t, 0.32, out.IdleShare, 1e-9, "weighted by each process's share")
	assert.Equal(t, int64(50), out.RoundTrips)
	assert.Equal(t, int64(15), out.Commits)
	assert.Equal(t, int64(300), out.RSSKB)

	_, _, err = combine([]*childResult{{DoneAtNs: sec}}, 10)
	assert.Error(t, err, "no process received anything")
}

// The tail target shows beside each p99 the longest disk sync and wake lag
// the probes saw meanwhile, when there were probes.
func TestTailTargetShowsTheDiskSync(t *testing.T) {
	r := &Report{Results: []Result{
		{Broker: Kafka, Row: RowOnceBatchHandler, Rate: 80000, PacedMsgs: 100, PacedRate: 40000, P99Ms: 58.9, DiskSyncMaxMs: 131.2, WakeLagMaxMs: 3.4, Correct: true},
		{Broker: Kafka, Row: RowOnceQueued, Rate: 80000, PacedMsgs: 100, PacedRate: 40000, P99Ms: 20, Correct: true},
	}}
	ts := r.pipelineTargets()
	assert.Equal(t, "target kafka once batch handler p99 <= 25 ms at half its rate: 58.9 ms at 40000 msgs/s (disk sync max 131 ms, wake lag max 3 ms), NOT met", ts[0].String())
	assert.Equal(t, "target kafka once queued p99 <= 25 ms at half its rate: 20.0 ms at 40000 msgs/s, met", ts[1].String())
}

// A diagnostic run without fsync commits without waiting for the disk:
// its figures show what the tail is without the disk's stalls, never
// evidence for a target, so no target is judged on them. A server of
// DATABASE_URL with fsync off (the test harness's) is judged as it is.
func TestTargetsAreNotJudgedWithoutFsync(t *testing.T) {
	r := &Report{Results: []Result{
		{Broker: Kafka, Row: RowHandwritten, Rate: 40000, Correct: true},
		{Broker: Kafka, Row: RowOnceBatchHandler, Rate: 44000, PacedMsgs: 100, PacedRate: 22000, P99Ms: 10, Correct: true},
	}}
	ratios(r)
	r.Machine.Fsync = "off"
	r.PGNoFsync = true
	lines := r.Targets()
	assert.Equal(t, []string{
		"targets: not judged: PostgreSQL ran with fsync=off (a diagnostic run; the library's guarantees need fsync on)",
		"effects exactly right in every row: yes",
	}, lines)

	r.PGNoFsync = false
	assert.Contains(t, r.Targets(), "target kafka best library row >= the hand-written batched row: 1.10x (once batch handler), met")
}

// The last line speaks for every row of the report: an HTTP row whose
// effects were wrong makes it NO, as it makes oncebench exit non-zero.
func TestCorrectLineCountsTheHTTPRows(t *testing.T) {
	r := &Report{
		Results: []Result{{Broker: Kafka, Row: RowNaive, Rate: 1000, Correct: true}},
		HTTP:    &HTTPReport{Rows: []HTTPResult{{Row: HTTPPlain, Correct: true}, {Row: HTTPIdempotency, Correct: false}}},
	}
	lines := r.Targets()
	assert.Equal(t, "effects exactly right in every row: NO", lines[len(lines)-1])
}

// A row whose effects were wrong meets no target: its rate and its tail
// are of work not done right (a lost write is work saved).
func TestTargetsOfARowWithWrongEffectsAreNotMet(t *testing.T) {
	r := &Report{
		Results: []Result{
			{Broker: Kafka, Row: RowNaive, Rate: 1000, Correct: true},
			{Broker: Kafka, Row: RowHandwritten, Rate: 15000, Correct: true},
			{Broker: Kafka, Row: RowOnceBatchHandler, Rate: 20000, PacedMsgs: 100, PacedRate: 10000, P99Ms: 10, Correct: false},
		},
		Outbox: []OutboxResult{{Broker: Kafka, VsCeiling: 0.9, Correct: false}},
	}
	ratios(r)
	assert.Equal(t, []string{
		"target Kafka once batch handler >= 10x naive: 20.0x (effects wrong), NOT met",
		"target Kafka once batch handler p99 <= 50 ms at half its rate: 10.0 ms at 10000 msgs/s (effects wrong), NOT met",
		"target kafka best library row >= the hand-written batched row: 1.33x (once batch handler) (effects wrong), NOT met",
		"target kafka once batch handler p99 <= 25 ms at half its rate: 10.0 ms at 10000 msgs/s (effects wrong) (1 run of the 3 in a row asked), NOT met",
		"target kafka outbox relay >= 50% of the broker's confirmed-publish ceiling: 90% (effects wrong), NOT met",
		"effects exactly right in every row: NO",
	}, r.Targets())
}

// The tail target asks for three runs in a row: fewer runs, each meeting
// it, are not enough to call it met.
func TestTailTargetNeedsThreeRunsInARow(t *testing.T) {
	row := func(run int) Result {
		return Result{Run: run, Broker: Kafka, Row: RowOnceBatchHandler, Rate: 20000, PacedMsgs: 100, PacedRate: 10000, P99Ms: 10, Correct: true}
	}
	one := &Report{Results: []Result{row(0)}}
	assert.Contains(t, one.Targets(), "target kafka once batch handler p99 <= 25 ms at half its rate: 10.0 ms at 10000 msgs/s (1 run of the 3 in a row asked), NOT met")

	two := &Report{Results: []Result{row(1), row(2)}}
	assert.Contains(t, two.Targets(), "target kafka once batch handler p99 <= 25 ms at half its rate: 10.0 ms at 10000 msgs/s | 10.0 ms at 10000 msgs/s; met in all 2 runs, NOT met: 3 runs in a row asked")

	three := &Report{Results: []Result{row(1), row(2), row(3)}}
	assert.Contains(t, three.Targets(), "target kafka once batch handler p99 <= 25 ms at half its rate: 10.0 ms at 10000 msgs/s | 10.0 ms at 10000 msgs/s | 10.0 ms at 10000 msgs/s; met in all 3 runs")
}

// A ratio to a row the run did not have is no figure: the table shows "-"
// for it, not 0.00 (which reads as a row that did nothing).
func TestTableShowsNoRatioWithoutItsRow(t *testing.T) {
	r := &Report{Results: []Result{
		{Broker: Kafka, Row: RowHandwritten, Rate: 10000, Correct: true},
		{Broker: Kafka, Row: RowOnceBatchHandler, Rate: 12000, Correct: true},
	}}
	ratios(r)
	var out strings.Builder
	assert.NoError(t, r.WriteTable(&out))
	var line string
	for _, l := range strings.Split(out.String(), "\n") {
		if strings.Contains(l, "once batch handler") && strings.Contains(l, "12000") {
			line = l
		}
	}
	cells := strings.Split(line, "|")
	for i := range cells {
		cells[i] = strings.TrimSpace(cells[i])
	}
	// x naive, x lower ceiling, x hand-written, correct, and the empty
	// cell after the last |.
	assert.Equal(t, []string{"-", "-", "1.20"}, cells[len(cells)-5:len(cells)-2], line)
}

// The header states the paced phase's length as asked, under a second too.
func TestHeaderStatesAShortPacedPhase(t *testing.T) {
	r := &Report{PaceSeconds: 0.3, PaceMax: 500}
	var out strings.Builder
	assert.NoError(t, r.WriteTable(&out))
	assert.Contains(t, out.String(), "over a paced phase of 0.3s per row")
}

// Processes that acked more than the backlog between them (a rebalance
// redelivered some) still give the mean of their figures: weights are
// each one's share of the acks, which add up to 1.
func TestCombineWeighsByTheAcks(t *testing.T) {
	sec := int64(1_000_000_000)
	out, _, err := combine([]*childResult{
		{Acked: 600, FirstAtNs: 10 * sec, DoneAtNs: 11 * sec, AllocsPerMsg: 40, IdleShare: 0.5},
		{Acked: 600, FirstAtNs: 10 * sec, DoneAtNs: 11 * sec, AllocsPerMsg: 40, IdleShare: 0.5},
	}, 1000)
	assert.NoError(t, err)
	assert.InDelta(t, 40, out.AllocsPerMsg, 1e-9)
	assert.InDelta(t, 0.5, out.IdleShare, 1e-9)
}

// TestJSONKeepsTheVerdicts: the JSON report holds the target lines the
// table prints, met and not met, so that a kept report says what it proved
// without recomputing it.
func TestJSONKeepsTheVerdicts(t *testing.T) {
	r := &Report{Results: []Result{
		{Run: 1, Broker: RabbitMQ, Row: RowCeiling, Rate: 40000, Correct: true},
		{Run: 1, Broker: RabbitMQ, Row: RowHandwritten, Rate: 39000, Correct: true},
		{Run: 1, Broker: RabbitMQ, Row: RowOnceBatchHandler, Rate: 30000, PacedMsgs: 100, PacedRate: 15000, P99Ms: 30, Correct: true},
	}}
	ratios(r)
	path := filepath.Join(t.TempDir(), "r.json")
	require.NoError(t, r.WriteJSON(path))
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	var got struct {
		Targets []string `json:"targets"`
	}
	require.NoError(t, json.Unmarshal(raw, &got))
	assert.Equal(t, r.Targets(), got.Targets)
	assert.NotEmpty(t, got.Targets)
	joined := strings.Join(got.Targets, "\n")
	assert.Contains(t, joined, "NOT met")
	assert.Contains(t, joined, "effects exactly right in every row: yes")
}

// A ratio against a row whose effects were wrong compares with work not
// done right: the table marks it, and no target resting on it is met; the
// targets say they were not judged, and why.
func TestRatiosAgainstRowsWithWrongEffectsJudgeNoTarget(t *testing.T) {
	r := &Report{Results: []Result{
		{Broker: Kafka, Row: RowCeiling, Rate: 50000, Correct: false, Check: "unacked 3"},
		{Broker: Kafka, Row: RowNaive, Rate: 1000, Correct: false},
		{Broker: Kafka, Row: RowHandwritten, Rate: 20000, Correct: false},
		{Broker: Kafka, Row: RowOnceBatched, Rate: 30000, Correct: true},
		{Broker: RabbitMQ, Row: RowCeiling, Rate: 40000, Correct: false, Check: "unacked 7"},
		{Broker: RabbitMQ, Row: RowOnceBatchHandler, Rate: 30000, Correct: true},
	}}
	ratios(r)
	assert.Equal(t, []string{
		"target Kafka once batched >= 10x naive: 30.0x (not judged: the naive row's effects were wrong), NOT met",
		"target Kafka once batched >= 50% of the lower ceiling: 60% (not judged: the ceiling row's effects were wrong), NOT met",
		"target kafka best library row >= the hand-written batched row: 1.50x (once batched) (not judged: the hand-written batched row's effects were wrong), NOT met",
		"target RabbitMQ best library row >= 70% of the consume-and-ack ceiling: 75% (once batch handler; ceiling 40000 msgs/s) (not judged: the ceiling row's effects were wrong), NOT met",
		"effects exactly right in every row: NO",
	}, r.Targets())

	var out strings.Builder
	require.NoError(t, r.WriteTable(&out))
	var line string
	for _, l := range strings.Split(out.String(), "\n") {
		if strings.Contains(l, "once batched|") {
			line = l
		}
	}
	cells := strings.Split(line, "|")
	for i := range cells {
		cells[i] = strings.TrimSpace(cells[i])
	}
	assert.Equal(t, []string{"30.00*", "0.60*", "1.50*"}, cells[len(cells)-5:len(cells)-2], line)
	assert.Contains(t, out.String(), "*: against a row of the same run whose effects were wrong or that failed")

	// The same rows with right effects: the ratios are judged.
	for i := range r.Results {
		r.Results[i].Correct = true
	}
	ratios(r)
	assert.Contains(t, r.Targets(), "target Kafka once batched >= 10x naive: 30.0x, met")
}

// A reference row that failed measured nothing: the targets resting on it
// are stated, not judged, rather than left out.
func TestRatiosAgainstAFailedRowJudgeNoTarget(t *testing.T) {
	r := &Report{Results: []Result{
		{Broker: Kafka, Row: RowNaive, Error: "row subprocess: exit status 1"},
		{Broker: Kafka, Row: RowOnceBatched, Rate: 30000, Correct: true},
		{Broker: RabbitMQ, Row: RowCeiling, Error: "row subprocess: exit status 1"},
		{Broker: RabbitMQ, Row: RowOnceBatchHandler, Rate: 30000, Correct: true},
	}}
	ratios(r)
	assert.Equal(t, []string{
		"target Kafka once batched >= 10x naive: - (not judged: the naive row failed), NOT met",
		"target RabbitMQ best library row >= 70% of the consume-and-ack ceiling: - (once batch handler; ceiling - msgs/s) (not judged: the ceiling row failed), NOT met",
		"effects exactly right in every row: NO",
	}, r.Targets())
}

// A library row that failed is stated in each target it would have been
// judged on, NOT met, rather than left out of the targets.
func TestTargetsOfAFailedRowAreStated(t *testing.T) {
	r := &Report{PGBench: 50000, PaceSeconds: 3, Results: []Result{
		{Broker: Kafka, Row: RowNaive, Rate: 1000, Correct: true},
		{Broker: Kafka, Row: RowHandwritten, Rate: 20000, Correct: true},
		{Broker: Kafka, Row: RowOnceBatched, Error: "row subprocess: killed after its deadline of 5m0s"},
	}}
	ratios(r)
	assert.Equal(t, []string{
		"target Kafka once batched >= 10x naive: - (row failed), NOT met",
		"target Kafka once batched >= 50% of the lower ceiling: - (row failed), NOT met",
		"target Kafka once batched p99 <= 50 ms at half its rate: - (row failed), NOT met",
		"target kafka best library row >= the hand-written batched row: - (once batched) (row failed), NOT met",
		"target kafka once batched p99 <= 25 ms at half its rate: - (row failed) (1 run of the 3 in a row asked), NOT met",
		"effects exactly right in every row: NO",
	}, r.Targets())
}

// The outbox table, like the consumer table, shows "-" for latencies that
// were not measured (no paced phase: -pace 0), not 0.0 ms.
func TestOutboxTableShowsNoLatencyWithoutPacedPhase(t *testing.T) {
	var out strings.Builder
	require.NoError(t, writeOutboxTable(&out, []OutboxResult{{Broker: Kafka, Rows: 3000, Rounds: 3, BatchSize: 500,
		CeilingRate: 20000, RelayRate: 15000, VsCeiling: 0.75, Correct: true, Check: "ok"}}))
	var line string
	for _, l := range strings.Split(out.String(), "\n") {
		if strings.Contains(l, "kafka|") {
			line = l
		}
	}
	cells := strings.Split(line, "|")
	for i := range cells {
		cells[i] = strings.TrimSpace(cells[i])
	}
	assert.Equal(t, []string{"kafka", "20000", "15000", "0.75", "-", "-", "-", "-", "-", "yes (ok)", ""}, cells, line)
}
