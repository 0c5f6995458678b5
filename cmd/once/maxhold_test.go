package main

import (
	"fmt"
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// dlq replay -max-hold sets how long a RabbitMQ replay holds the queue's
// messages unacked before it puts them back and takes them again
// (dlq.AMQPConfig.MaxHold): on a quorum queue each time adds one to a
// message's x-delivery-count, so the message not selected, held through
// a replay paced over a second with -max-hold 200ms, comes back with
// several. A value that is not above 0, or the flag with Kafka, is a
// usage error.
func TestDLQReplayMaxHold(t *testing.T) {
	url := testenv.AMQPURL(t)
	queue, target := testenv.Uniq("hold.dlq"), testenv.Uniq("hold")
	testenv.DeleteQueues(t, url, queue, target)
	ch := testenv.AMQPChannel(t, url)
	_, err := ch.QueueDeclare(queue, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"})
	require.NoError(t, err)
	_, err = ch.QueueDeclare(target, true, false, false, false, nil)
	require.NoError(t, err)
	for i := range 4 {
		id := fmt.Sprintf("pay-%d", i)
		if i == 3 {
			id = "keep-3"
		}
		testenv.PublishAMQP(t, ch, queue, amqp091.Publishing{MessageId: id, Body: []byte(id), Headers: amqp091.Table{
			consumer.HeaderEventID: id, "once-original-exchange": "", "once-original-routing-key": target,
		}})
	}
	env := map[string]string{"ONCE_AMQP_URL": url}

	// Three records, two per second: a second of waits, the fourth held
	// throughout.
	code, out, errOut := cli(t, env, "dlq", "replay", "-dlq", queue, "-id", "pay-*", "-rate", "2", "-max-hold", "200ms")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "replayed 3")
	d, ok, err := ch.Get(queue, true)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, "keep-3", string(d.Body))
	count, _ := d.Headers["x-delivery-count"].(int64)
	assert.GreaterOrEqual(t, count, int64(3), "put back every 200ms while the replay waited: %v", d.Headers)

	for _, v := range []string{"0s", "-1s"} {
		code, _, errOut = cli(t, env, "dlq", "replay", "-dlq", queue, "-all", "-max-hold", v)
		assert.Equal(t, exitUsage, code, "-max-hold %s: %s", v, errOut)
		assert.Contains(t, errOut, "-max-hold", v)
	}
	code, _, errOut = cli(t, nil, "dlq", "replay", "-kafka", "127.0.0.1:1", "-dlq", queue, "-all", "-max-hold", "1m")
	assert.Equal(t, exitUsage, code, errOut)
	assert.Contains(t, errOut, "-max-hold", "a RabbitMQ flag given with Kafka")
}
