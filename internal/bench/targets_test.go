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
