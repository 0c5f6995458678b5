package amqp_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// An envelope whose id is 200,000 bytes long is dead-lettered invalid-id,
// and its copy names that id in once-event-id: the copy's header table is
// larger than the frame RabbitMQ accepts (frame_max, 128 KiB by default;
// the content header cannot be split), and the broker closed the
// dead-letter connection with FRAME_ERROR on every attempt, so the message
// was never settled. The copy now keeps the original body and headers,
// with the diagnostic cut and named in once-diagnostics-cut.
func TestDeadLetterWithAnIDTooLongForAFrameIsSettled(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	longID := strings.Repeat("i", 200_000)
	body := []byte(`{"id":"` + longID + `","type":"t","data":{"n":1}}`)
	require.NoError(t, a.publish("", q,
		amqp091.Publishing{Body: body, Headers: amqp091.Table{"x-origin": "test"}},
		amqp091.Publishing{Body: []byte(`{"id":"good-1","type":"t","data":{"n":2}}`)}))

	pool := effectsDB(t)
	src := openSource(t, amqp.Config{Queue: q})
	r := startConsumer(t, pool, src, consumer.Config{Name: "big-id", Envelope: consumer.JSONEnvelope{},
		Retry: consumer.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond}}, recordEffect)
	require.Eventually(t, func() bool {
		st := r.c.Stats()
		return st.Handled == 1 && st.DeadLettered == 1
	}, 30*time.Second, 10*time.Millisecond, "the long id's copy is written and the message settled")
	require.NoError(t, r.stop())
	requireExactlyOnce(t, pool, []string{"good-1"})

	dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, dead, 1)
	h := amqp.HeaderStrings(dead[0].Headers)
	assert.Equal(t, body, dead[0].Body, "the original body, whole")
	assert.Equal(t, "test", h["x-origin"], "the original headers are kept")
	assert.Equal(t, string(consumer.KindInvalidID), h[consumer.HeaderErrorKind])
	assert.Equal(t, longID[:4096], h[consumer.HeaderEventID], "the id, cut")
	assert.Equal(t, consumer.HeaderEventID, h[amqp.HeaderDiagnosticsCut])
	assert.Equal(t, q, h[amqp.HeaderOriginalQueue])
	ready, err := a.ready(q)
	require.NoError(t, err)
	assert.Zero(t, ready)
}

// panicDeadLetter is the dead letter of a handler panic, with an error
// message and a stack as long as the consumer writes them (4096 bytes).
func panicDeadLetter(id string) *consumer.DeadLetter {
	return &consumer.DeadLetter{Consumer: "big-headers", EventID: id, Kind: consumer.KindPanic, Attempts: 3,
		Error: strings.Repeat("e", 4096), Stack: strings.Repeat("s", 4096), FailedAt: time.Now()}
}

// A message whose own headers nearly fill a frame (a 126,000-byte header;
// frame_max is 128 KiB) is delivered, but its copy adds 8 KiB of error
// message and stack: the broker closed the dead-letter connection with
// FRAME_ERROR on every attempt. The copy is now written with the body and
// the diagnostics, without the original headers, and says so.
func TestDeadLetterCopyOfHeadersTooLargeForAFrameDropsThem(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	body := []byte(`{"n":1}`)
	require.NoError(t, a.publish("", q, amqp091.Publishing{MessageId: "ev-1", Type: "order.paid", Body: body,
		Headers: amqp091.Table{"x-big": strings.Repeat("h", 126_000), "x-small": int32(7)}}))
	src := openSource(t, amqp.Config{Queue: q})
	d := receive(t, src)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, d.DeadLetter(ctx, panicDeadLetter("ev-1")))
	require.NoError(t, d.Ack(ctx))

	dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, dead, 1)
	c := dead[0]
	h := amqp.HeaderStrings(c.Headers)
	assert.Equal(t, body, c.Body, "the body, whole")
	assert.Equal(t, "ev-1", c.MessageId)
	assert.Equal(t, "order.paid", c.Type)
	assert.NotContains(t, h, "x-big")
	assert.NotContains(t, h, "x-small")
	// The table: its length, "x-big" (1+5 name, 1+4+126000 value) and "x-small" (1+7, 1+4).
	assert.Equal(t, strconv.Itoa(4+6+5+126_000+8+5), h[amqp.HeaderOriginalDropped])
	assert.Equal(t, strings.Repeat("e", 4096), h[consumer.HeaderErrorMessage], "the diagnostics are whole")
	assert.Equal(t, strings.Repeat("s", 4096), h[consumer.HeaderErrorStack])
	assert.NotContains(t, h, amqp.HeaderDiagnosticsCut)
	assert.Equal(t, "ev-1", h[consumer.HeaderEventID])
	assert.Equal(t, q, h[amqp.HeaderOriginalQueue])
	assert.Equal(t, q, h[amqp.HeaderOriginalRoutingKey])
}

// On a broker whose frame_max is its minimum, 4096 bytes, no panic's dead
// letter fitted a frame (4096 bytes of error message, as many of stack):
// every one was retried without end. The copy now cuts the diagnostics
// until its properties fit, and names what it cut.
func TestDeadLetterCopyFitsTheSmallestFrame(t *testing.T) {
	t.Parallel()
	n := privateNode(t)
	n.ctl(t, "eval", "application:set_env(rabbit, frame_max, 4096).")
	a := newAdminAt(t, n.url)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	body := []byte(strings.Repeat("b", 20_000)) // a body spans frames
	require.NoError(t, a.publish("", q, amqp091.Publishing{MessageId: "ev-1", Body: body,
		Headers: amqp091.Table{"x-origin": "test"}}))
	src := openSource(t, amqp.Config{URL: n.url, Queue: q})
	d := receive(t, src)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, d.DeadLetter(ctx, panicDeadLetter("ev-1")))
	require.NoError(t, d.Ack(ctx))

	dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, dead, 1)
	h := amqp.HeaderStrings(dead[0].Headers)
	assert.Equal(t, body, dead[0].Body, "the body, whole")
	assert.Equal(t, consumer.HeaderErrorMessage+","+consumer.HeaderErrorStack, h[amqp.HeaderDiagnosticsCut])
	assert.Equal(t, strings.Repeat("e", 1024), h[consumer.HeaderErrorMessage])
	assert.Equal(t, strings.Repeat("s", 1024), h[consumer.HeaderErrorStack])
	assert.NotEmpty(t, h[amqp.HeaderOriginalDropped])
	assert.NotContains(t, h, "x-origin")
	assert.Equal(t, "ev-1", h[consumer.HeaderEventID])
	assert.Equal(t, string(consumer.KindPanic), h[consumer.HeaderErrorKind])
}

// RabbitMQ checks max_message_size against the body alone, on publish: a
// message already in a queue when the limit is lowered (or one that came
// in another way than an AMQP 0-9-1 publish) is delivered whole, but its
// copy is refused with 406 PRECONDITION_FAILED on every attempt, and the
// message was never settled. The copy is now written without the body,
// with its size in once-value-dropped, the original headers and the
// diagnostics; the next dead letter goes out as usual. A body at the
// limit is copied whole, however long its diagnostic headers: RabbitMQ
// counts the body alone against max_message_size.
func TestDeadLetterCopyOfABodyOverMaxMessageSizeDropsIt(t *testing.T) {
	t.Parallel()
	n := privateNode(t)
	a := newAdminAt(t, n.url)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	big := []byte(strings.Repeat("b", 8192))
	edge := []byte(strings.Repeat("e", 4096))
	require.NoError(t, a.publish("", q,
		amqp091.Publishing{MessageId: "big", Type: "blob", ContentType: "application/octet-stream", Body: big,
			Headers: amqp091.Table{"x-origin": "test"}},
		amqp091.Publishing{MessageId: "small", Body: []byte("s")},
		amqp091.Publishing{MessageId: "edge", Body: edge}))
	n.ctl(t, "eval", "application:set_env(rabbit, max_message_size, 4096).")
	src := openSource(t, amqp.Config{URL: n.url, Queue: q, Prefetch: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, id := range []string{"big", "small", "edge"} {
		d := receive(t, src)
		require.Equal(t, id, d.Message().ID)
		dl := &consumer.DeadLetter{Consumer: "big-body", EventID: id, Kind: consumer.KindHandler,
			Attempts: 3, Error: "always fails", FailedAt: time.Now()}
		if id == "edge" {
			dl = panicDeadLetter(id)
		}
		require.NoError(t, d.DeadLetter(ctx, dl), id)
		require.NoError(t, d.Ack(ctx))
	}

	dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, dead, 3)
	// A body at the limit, with 8 KiB of diagnostics beside it: the
	// broker counts the body alone.
	assert.Equal(t, edge, dead[2].Body)
	assert.NotContains(t, amqp.HeaderStrings(dead[2].Headers), amqp.HeaderValueDropped)
	assert.Equal(t, strings.Repeat("s", 4096), amqp.HeaderStrings(dead[2].Headers)[consumer.HeaderErrorStack])
	c := dead[0]
	h := amqp.HeaderStrings(c.Headers)
	assert.Equal(t, "big", c.MessageId)
	assert.Empty(t, c.Body, "the body the broker refuses is dropped")
	assert.Equal(t, "8192", h[amqp.HeaderValueDropped])
	assert.Equal(t, "test", h["x-origin"], "the original headers are kept")
	assert.Equal(t, "big", h[consumer.HeaderEventID])
	assert.Equal(t, "always fails", h[consumer.HeaderErrorMessage])
	assert.Equal(t, "blob", c.Type)
	assert.Equal(t, "application/octet-stream", c.ContentType)
	assert.Equal(t, q, h[amqp.HeaderOriginalQueue])
	assert.Equal(t, []byte("s"), dead[1].Body, "the next copy keeps its body")
	assert.NotContains(t, amqp.HeaderStrings(dead[1].Headers), amqp.HeaderValueDropped)
	ready, err := a.ready(q)
	require.NoError(t, err)
	assert.Zero(t, ready)
}

// A message whose header table holds nearly as many entries as amqp091
// reads in one table (8192) is delivered, but its copy adds the diagnostic
// and once-original-* headers: the broker took a copy of more than 8192
// entries, which no amqp091 client reads (it closes the connection with a
// syntax error), so once dlq failed on it at every read, and on every copy
// queued behind it. The copy is now written without the original headers,
// and says so.
func TestDeadLetterCopyOfTooManyHeadersForAClientDropsThem(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	h := amqp091.Table{}
	for i := range 8190 {
		h["h"+strconv.Itoa(i)] = nil
	}
	require.NoError(t, a.publish("", q, amqp091.Publishing{MessageId: "ev-1", Body: []byte(`{}`), Headers: h}))
	src := openSource(t, amqp.Config{Queue: q})
	d := receive(t, src)
	require.Len(t, d.Message().Headers, 8190, "the original is read whole")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, d.DeadLetter(ctx, &consumer.DeadLetter{Consumer: "many-headers", EventID: "ev-1",
		Kind: consumer.KindHandler, Error: "boom", Attempts: 1, FailedAt: time.Now()}))
	require.NoError(t, d.Ack(ctx))

	dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err, "the copy cannot be read by an amqp091 client")
	require.Len(t, dead, 1)
	assert.LessOrEqual(t, len(dead[0].Headers), 8192)
	got := amqp.HeaderStrings(dead[0].Headers)
	assert.Equal(t, "ev-1", got[consumer.HeaderEventID])
	assert.NotEmpty(t, got[amqp.HeaderOriginalDropped], "the copy says the original headers were dropped")
	assert.Equal(t, []byte(`{}`), dead[0].Body)
}
