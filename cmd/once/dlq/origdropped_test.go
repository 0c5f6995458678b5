package dlq_test

import (
	"strings"
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/internal/pgtest"
)

// A RabbitMQ dead letter whose original headers did not fit one frame
// beside the diagnostic headers is written without them
// (once-original-dropped; docs/amqp.md, "Copies too large for a frame").
// once dlq replay took it for replayable and published it without those
// headers, although the event's id was one of them (the "id" header, one of
// the default IDHeaders). The consumer that dead-lettered it identifies
// the copy by once-redrive-event-id and is fine; every other consumer of
// the exchange identifies the copy its own way, as its first delivery, and
// found no id in it: with the hash fallback it claimed the copy under
// another id than the one it had handled the original under, and applied
// the event a second time (without a fallback it would dead-letter it
// missing-id). docs/guarantees.md promises that "another consumer of the
// topic that handled the record (another queue bound to the exchange)
// skips the copy as its duplicate". A copy without its original headers
// cannot be put back as the original was: it is not replayable, unless
// forced (an operator who knows no other consumer reads the exchange).
func TestAMQPReplayOfACopyWithoutItsOriginalHeadersDoublesNoEffect(t *testing.T) {
	url := testenv.AMQPURL(t)
	exchange := testenv.Uniq("orders-x")
	qa, qb := testenv.Uniq("billing"), testenv.Uniq("shipping")
	testenv.DeleteQueues(t, url, qa, qa+".dlq", qb, qb+".dlq")
	poolA, _ := pgtest.Schema(t)
	poolB, _ := pgtest.Schema(t)
	billing := testenv.StartService(t, poolA, testenv.OpenAMQPSource(t, url, qa), "billing")
	shipping := testenv.StartService(t, poolB, testenv.OpenAMQPSource(t, url, qb), "shipping")
	shipping.Broken.Store(false) // shipping handles the event; billing fails it

	ch := testenv.AMQPChannel(t, url)
	require.NoError(t, ch.ExchangeDeclare(exchange, "fanout", false, true, false, false, nil))
	require.NoError(t, ch.QueueBind(qa, "", exchange, false, nil))
	require.NoError(t, ch.QueueBind(qb, "", exchange, false, nil))
	// The event's id is in its "id" header, beside a header large enough
	// that the message fits a 128 KiB frame and its dead-letter copy, with
	// the diagnostics, does not.
	p := amqp091.Publishing{Body: testenv.JSON(1, "fail"), ContentType: "application/json",
		Headers: amqp091.Table{"id": "ev-1", "x-baggage": strings.Repeat("b", 130_900)}}
	c, err := ch.PublishWithDeferredConfirmWithContext(ctxT(t), exchange, "", true, false, p)
	require.NoError(t, err)
	ok, err := c.WaitContext(ctxT(t))
	require.NoError(t, err)
	require.True(t, ok)
	billing.WaitSettled(t, 1)
	shipping.WaitSettled(t, 1)
	require.EqualValues(t, 1, billing.C.Stats().DeadLettered)
	require.Equal(t, map[string]int{"ev-1": 1}, shipping.Effects(t))

	q, err := dlq.NewAMQP(dlq.AMQPConfig{URL: url, Queue: qa + ".dlq"})
	require.NoError(t, err)
	recs, err := dlq.Collect(ctxT(t), q, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, recs, 1)
	require.NotEmpty(t, recs[0].Header(amqp.HeaderOriginalDropped), "the copy was written without its original headers")
	require.Equal(t, "ev-1", recs[0].EventID())

	billing.Broken.Store(false)
	rep, err := q.Replay(ctxT(t), dlq.Filter{Consumer: "billing"}, dlq.ReplayOptions{})
	require.NoError(t, err)
	if rep.Replayed == 1 {
		billing.WaitSettled(t, 2)
		shipping.WaitSettled(t, 2)
	}
	assert.Equal(t, map[string]int{"ev-1": 1}, shipping.Effects(t),
		"shipping handled ev-1 once; the redrive of billing's dead letter must be its duplicate, not a new event")
	assert.Equal(t, 1, rep.Skipped, "a copy without its original headers is not replayable: %+v", rep.Outcomes)
	assert.NoError(t, recs[0].Replayable(true), "forced, it is")
}
