package bench

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestPipelineTargets(t *testing.T) {
	r := &Report{Results: []Result{
		{Broker: RabbitMQ, Row: RowCeiling, Rate: 40000, PacedMsgs: 100, PacedRate: 20000, P99Ms: 90},
		{Broker: RabbitMQ, Row: RowHandwritten, Rate: 39000, PacedMsgs: 100, PacedRate: 19500, P99Ms: 90},
		{Broker: RabbitMQ, Row: RowOnceQueued, Rate: 20000, PacedMsgs: 100, PacedRate: 10000, P99Ms: 12},
		{Broker: RabbitMQ, Row: RowOnceBatchHandler, Rate: 30000, PacedMsgs: 100, PacedRate: 15000, P99Ms: 30},
		{Broker: Kafka, Row: RowOnceBatchHandler, Rate: 60000},
	}}
	assert.Equal(t, []string{
		"target RabbitMQ best library row (once batch handler) >= 70% of the consume-and-ack ceiling (40000 msgs/s): 75%, met",
		"target rabbitmq once queued p99 <= 25 ms at half its rate (10000 msgs/s): 12.0 ms, met",
		"target rabbitmq once batch handler p99 <= 25 ms at half its rate (15000 msgs/s): 30.0 ms, NOT met",
	}, r.pipelineTargets())
}

func TestCombineScaleOutProcesses(t *testing.T) {
	sec := int64(1_000_000_000)
	results := []*childResult{
		{Acked: 600, FirstAtNs: 10 * sec, DoneAtNs: 12 * sec, AllocsPerMsg: 40, RoundTrips: 30, Commits: 10, RSSKB: 100},
		{Acked: 400, FirstAtNs: 11 * sec, DoneAtNs: 12*sec + sec/2, AllocsPerMsg: 50, RoundTrips: 20, Commits: 5, RSSKB: 300},
		{Acked: 0, DoneAtNs: 12 * sec}, // received nothing
	}
	out, shares, err := combine(results, 1000)
	assert.NoError(t, err)
	assert.Equal(t, []int{600, 400, 0}, shares)
	assert.InDelta(t, 2.5, out.Seconds, 1e-9, "from the first delivery of any process to the last one done")
	assert.InDelta(t, 400, out.Rate, 1e-9)
	assert.InDelta(t, 44, out.AllocsPerMsg, 1e-9, "weighted by each process's share")
	assert.Equal(t, int64(50), out.RoundTrips)
	assert.Equal(t, int64(15), out.Commits)
	assert.Equal(t, int64(300), out.RSSKB)

	_, _, err = combine([]*childResult{{DoneAtNs: sec}}, 10)
	assert.Error(t, err, "no process received anything")
}
