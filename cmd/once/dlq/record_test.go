package dlq

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/IBM/sarama"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

func rec(headers ...string) *Record {
	r := &Record{Partition: 0, Offset: 1}
	for i := 0; i+1 < len(headers); i += 2 {
		r.Headers = append(r.Headers, Header{headers[i], headers[i+1]})
	}
	return r
}

func TestFilterMatch(t *testing.T) {
	r := rec(consumer.HeaderConsumer, "billing", consumer.HeaderErrorKind, "handler", consumer.HeaderEventID, "order-17",
		consumer.HeaderErrorMessage, "Payment REJECTED", consumer.HeaderFailedAt, "2026-11-25T10:00:00Z")
	r.Ref = "0:1"
	at := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		f    Filter
		want bool
	}{
		{Filter{}, true},
		{Filter{Consumer: "billing"}, true},
		{Filter{Consumer: "shipping"}, false},
		{Filter{Kinds: []string{"panic", "handler"}}, true},
		{Filter{Kinds: []string{"panic"}}, false},
		{Filter{EventID: "order-*"}, true},
		{Filter{EventID: "order-1"}, false},
		{Filter{EventID: "order-17"}, true},
		{Filter{Since: at}, true},
		{Filter{Since: at.Add(time.Second)}, false},
		{Filter{Until: at}, false},
		{Filter{Until: at.Add(time.Second)}, true},
		{Filter{Refs: []string{"0:1"}}, true},
		{Filter{Refs: []string{"0:2"}}, false},
		{Filter{Search: "payment rejected"}, true},
		{Filter{Search: "refund"}, false},
	} {
		assert.Equal(t, c.want, c.f.Match(r), "%+v", c.f)
	}
	assert.False(t, (&Filter{Since: at}).Match(rec()), "no failed-at header: no time bound matches")
}

// A trailing * is a prefix; escaped, it is the id's own last character,
// so that an id ending in a star can be selected alone.
func TestFilterEventIDWithAnEscapedStar(t *testing.T) {
	for _, c := range []struct {
		pattern, id string
		want        bool
	}{
		{`sku\*`, "sku*", true},
		{`sku\*`, "sku*-2", false},
		{`sku\*`, `sku\`, false},
		{"sku*", "sku*-2", true},
		{`sku\\*`, `sku\x`, true},
		{`sku\\*`, "sku*", false},
		{`sku\\\*`, `sku\*`, true},
		{`a\b`, `a\b`, true},
		{`\*`, "*", true},
		{`\*`, "x", false},
	} {
		r := rec(consumer.HeaderEventID, c.id)
		assert.Equal(t, c.want, (&Filter{EventID: c.pattern}).Match(r), "%s on %s", c.pattern, c.id)
	}
}

// Check refuses the fields that are set but select every record (or
// nearly): a filter of them only would have a replay redrive them all.
func TestFilterCheckRefusesFieldsThatCannotNarrow(t *testing.T) {
	for _, f := range []Filter{{EventID: "*"}, {Search: " "}, {Search: "\t \n"}, {Consumer: "billing", EventID: "*"}} {
		assert.Error(t, f.Check(), "%+v", f)
	}
	for _, f := range []Filter{{}, {EventID: "order-*"}, {EventID: "**"}, {Search: "payment rejected"}, {Search: " order "}} {
		assert.NoError(t, f.Check(), "%+v", f)
	}
}

// Search looks in what the commands say it looks in (the event id and
// type, the error, the consumer and the kind), not in the ref: a search
// for an order number would select, and replay, every dead letter whose
// Kafka offset or RabbitMQ digest happens to contain those digits.
func TestSearchDoesNotMatchTheRef(t *testing.T) {
	r := rec(consumer.HeaderConsumer, "billing", consumer.HeaderErrorKind, "handler", consumer.HeaderEventID, "order-17",
		consumer.HeaderErrorMessage, "order 17: payment rejected")
	for _, ref := range []string{"0:4711", "9c4711e0a2b3d4f5"} {
		r.Ref = ref
		assert.False(t, (&Filter{Search: "4711"}).Match(r), "ref %s: order 4711 is not this record's", ref)
		assert.True(t, (&Filter{Search: "17"}).Match(r), "ref %s", ref)
	}
}

func TestReplayable(t *testing.T) {
	ok := rec(consumer.HeaderEventID, "e", consumer.HeaderOriginalTopic, "orders", consumer.HeaderErrorKind, "handler")
	require.NoError(t, ok.Replayable(false))
	for name, r := range map[string]*Record{
		"no id":          rec(consumer.HeaderOriginalTopic, "orders", consumer.HeaderErrorKind, "missing-id"),
		"no destination": rec(consumer.HeaderEventID, "e"),
		"value dropped":  rec(consumer.HeaderEventID, "e", consumer.HeaderOriginalTopic, "orders", "once-value-dropped", "9000000"),
		"id conflict":    rec(consumer.HeaderEventID, "e", consumer.HeaderOriginalTopic, "orders", consumer.HeaderErrorKind, "id-conflict"),
	} {
		assert.ErrorIs(t, r.Replayable(false), ErrNotReplayable, name)
	}
	kafkaNoID := rec(consumer.HeaderOriginalTopic, "orders", consumer.HeaderErrorKind, "decode", consumer.HeaderFallbackID, "orders/0/3@t")
	assert.NoError(t, kafkaNoID.Replayable(false), "no id yet, but its first position")
	amqpNoID := rec(consumer.HeaderErrorKind, "decode", "once-original-exchange", "", "once-original-routing-key", "orders")
	amqpNoID.Properties = &Properties{}
	assert.NoError(t, amqpNoID.Replayable(false), "an AMQP id never comes from a position")
	assert.NotContains(t, redriveHeaders(kafkaNoID, time.Now(), ""), Header{consumer.HeaderRedriveEventID, ""},
		"no empty redrive id")
	conflict := rec(consumer.HeaderEventID, "e", consumer.HeaderOriginalTopic, "orders", consumer.HeaderErrorKind, "id-conflict")
	assert.NoError(t, conflict.Replayable(true), "force")
	amqpNoExchange := rec(consumer.HeaderEventID, "e")
	amqpNoExchange.Properties = &Properties{}
	assert.Error(t, amqpNoExchange.Replayable(false))
	amqpNoBody := rec(consumer.HeaderEventID, "e", "once-original-exchange", "", "once-original-routing-key", "orders",
		amqp.HeaderValueDropped, "8192")
	amqpNoBody.Properties = &Properties{}
	err := amqpNoBody.Replayable(true)
	assert.ErrorIs(t, err, ErrNotReplayable, "an AMQP copy without its body, even forced")
	assert.ErrorContains(t, err, "without its body (8192 bytes")
	for _, h := range []string{consumer.HeaderEventID, consumer.HeaderFallbackID, consumer.HeaderConsumer} {
		cut := rec(consumer.HeaderEventID, "e", "once-original-exchange", "", "once-original-routing-key", "orders",
			consumer.HeaderErrorKind, "handler", amqp.HeaderDiagnosticsCut, consumer.HeaderErrorMessage+","+h)
		cut.Properties = &Properties{}
		err := cut.Replayable(true)
		assert.ErrorIs(t, err, ErrNotReplayable, "an AMQP copy whose %s was cut, even forced", h)
		assert.ErrorContains(t, err, h)
	}
	stackCut := rec(consumer.HeaderEventID, "e", "once-original-exchange", "", "once-original-routing-key", "orders",
		consumer.HeaderErrorKind, "handler", amqp.HeaderDiagnosticsCut, consumer.HeaderErrorMessage+","+consumer.HeaderErrorStack)
	stackCut.Properties = &Properties{}
	assert.NoError(t, stackCut.Replayable(false), "the error cut: the redrive is the same")
	amqpDefault := rec(consumer.HeaderEventID, "e", "once-original-exchange", "", "once-original-routing-key", "orders")
	amqpDefault.Properties = &Properties{}
	assert.Equal(t, "(default)/orders", amqpDefault.Destination())
}

// The redrive headers count on from the record's own count, and the
// diagnostic headers of the dead-lettering are not carried back.
func TestKafkaRedriveHeaders(t *testing.T) {
	r := rec("id", "a", consumer.HeaderEventID, "e-1", consumer.HeaderRedriveCount, "2", consumer.HeaderErrorKind, "handler",
		consumer.HeaderOriginalTopic, "orders", consumer.HeaderOriginalPartition, "3", "x-trace", "t",
		consumer.HeaderConsumer, "billing", consumer.HeaderFallbackID, "orders/3/17@t", consumer.HeaderRedriveConsumer, "old")
	r.raw = toSarama(r.Headers)
	at := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	m := kafkaRedrive(r, redriveHeaders(r, at, "alice"))
	assert.Equal(t, "orders", m.Topic)
	assert.EqualValues(t, 3, m.Partition)
	var got []Header
	for _, h := range m.Headers {
		got = append(got, Header{string(h.Key), string(h.Value)})
	}
	assert.Equal(t, []Header{
		{"id", "a"}, {"x-trace", "t"},
		{consumer.HeaderRedriveEventID, "e-1"}, {consumer.HeaderRedriveConsumer, "billing"},
		{consumer.HeaderRedriveFallbackID, "orders/3/17@t"}, {consumer.HeaderRedriveCount, "3"},
		{consumer.HeaderRedrivenAt, "2026-11-25T10:00:00Z"}, {consumer.HeaderRedrivenBy, "alice"},
	}, got)
}

// A redrive carries back none of the diagnostic headers a dead-lettering
// writes, whatever their kind (the SQLSTATE of a database error among
// them): a redriven record that fails again for another reason must not
// be dead-lettered with the diagnostics of its earlier failure.
func TestRedriveDropsEveryDiagnosticHeader(t *testing.T) {
	dl := &consumer.DeadLetter{Kind: consumer.KindHandler, Error: "duplicate key", Stack: "goroutine 1", Consumer: "billing",
		EventID: "e-1", EventType: "order.paid", Attempts: 3, FailedAt: time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC),
		Extra: map[string]string{consumer.HeaderErrorSQLState: "23505", consumer.HeaderFingerprint: "ab",
			consumer.HeaderOriginalFingerprint: "cd", consumer.HeaderOriginalProcessedAt: "2026-11-25T09:00:00Z"}}
	diag := dl.Headers(&consumer.Message{Topic: "orders", Partition: 2, Offset: 7, FallbackID: "orders/2/7@t", Timestamp: time.Now()})
	delete(diag, consumer.HeaderTraceParent) // the original's trace context, not a diagnostic of the failure
	// The marks of a copy shaped to fit a frame.
	diag[amqp.HeaderDiagnosticsCut] = consumer.HeaderErrorMessage
	diag[amqp.HeaderOriginalDropped] = "130000"
	r := rec("id", "e-1", "x-trace", "t")
	for k, v := range diag {
		r.Headers = append(r.Headers, Header{k, v})
	}
	r.raw = toSarama(r.Headers)
	redrive := redriveHeaders(r, time.Now(), "")

	kept := map[string]bool{}
	for _, h := range kafkaRedrive(r, redrive).Headers {
		kept[string(h.Key)] = true
	}
	d := &amqp091.Delivery{Headers: amqp091.Table{"id": "e-1"}}
	for k, v := range diag {
		d.Headers[k] = v
	}
	for k := range amqpRedrive(d, redrive, "").Headers {
		kept["amqp "+k] = true
	}
	for k := range diag {
		assert.False(t, kept[k], "kafka redrive carries %s back", k)
		assert.False(t, kept["amqp "+k], "amqp redrive carries %s back", k)
	}
	assert.True(t, kept["id"] && kept["amqp id"], "the original headers are kept")
}

func TestPacer(t *testing.T) {
	ctx := context.Background()
	p := newPacer(1000)
	defer p.stop()
	require.NoError(t, p.wait(ctx), "the first publish goes at once")
	require.NoError(t, p.wait(ctx))
	slow := newPacer(0.001)
	defer slow.stop()
	require.NoError(t, slow.wait(ctx), "the first publish goes at once")
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorIs(t, slow.wait(cctx), context.Canceled, "a cancelled wait returns at once")
}

func toSarama(hs []Header) []sarama.RecordHeader {
	out := make([]sarama.RecordHeader, len(hs))
	for i, h := range hs {
		out[i] = sarama.RecordHeader{Key: []byte(h.Key), Value: []byte(h.Value)}
	}
	return out
}

func TestPacerAtTheEdgesOfTheClock(t *testing.T) {
	ctx := context.Background()
	fast := newPacer(2e9) // an interval below a nanosecond: no bound
	defer fast.stop()
	require.NoError(t, fast.wait(ctx))
	require.NoError(t, fast.wait(ctx))
	slow := newPacer(1e-300) // an interval past the longest Duration
	defer slow.stop()
	require.NoError(t, slow.wait(ctx), "the first publish goes at once")
	cctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, slow.wait(cctx), context.DeadlineExceeded, "the second waits")
	for _, rate := range []float64{math.NaN(), math.Inf(1), -1} {
		o := ReplayOptions{Rate: rate}
		require.ErrorIs(t, o.validate(), ErrBadOptions, "rate %v", rate)
	}
}

// A RabbitMQ dead letter keeps its original's CC header (more routing keys)
// as once-original-cc, so that the broker does not route the copy by it. A
// redrive publishes it as CC again: the message goes back to every queue
// it was published to, the one it failed in among them even when it
// reached that queue by a CC key alone.
func TestAMQPRedriveRestoresCC(t *testing.T) {
	cc := []any{"billing", "shipping"}
	d := &amqp091.Delivery{Headers: amqp091.Table{amqp.HeaderOriginalCC: cc, "x-origin": "test",
		consumer.HeaderEventID: "e-1", amqp.HeaderOriginalRoutingKey: "orders"}}
	p := amqpRedrive(d, []Header{{consumer.HeaderRedriveEventID, "e-1"}}, "")
	assert.Equal(t, cc, p.Headers["CC"])
	assert.NotContains(t, p.Headers, amqp.HeaderOriginalCC)
	assert.Equal(t, "test", p.Headers["x-origin"])
}

// A RabbitMQ dead letter read from a quorum queue carries the broker's
// x-delivery-count of that queue (every read of the dead letters counts),
// and so may the copy of a message redelivered in its own queue. Carried
// back by a redrive it made the replayed message look redelivered to the
// consumer (a crash suspect, run alone with a crash-guard write). The
// redrive drops it: the broker counts the redriven message's deliveries
// afresh.
func TestAMQPRedriveDropsTheDeliveryCount(t *testing.T) {
	r := rec("id", "e-1")
	redrive := redriveHeaders(r, time.Now(), "")
	d := &amqp091.Delivery{Headers: amqp091.Table{"id": "e-1", amqp.DeliveryCountHeader: int64(3)}}
	out := amqpRedrive(d, redrive, "").Headers
	assert.NotContains(t, out, amqp.DeliveryCountHeader)
	assert.Equal(t, "e-1", out["id"])
}

// RabbitMQ 4.3 counts, in x-acquired-count, every time a quorum queue gave
// a message to a consumer, a read that puts it back included: a dead letter
// of a quorum queue carries a new count at every read. Its ref leaves the
// count out, as it leaves out x-delivery-count, so the ref a listing shows
// still selects the record at the next read (once dlq replay -ref, the
// console's record page and replay); a redrive leaves it out as well, so the
// redriven message does not arrive counted.
func TestAMQPRefAndRedriveLeaveOutTheAcquiredCount(t *testing.T) {
	delivery := func(n any) *amqp091.Delivery {
		h := amqp091.Table{consumer.HeaderEventID: "e-1", consumer.HeaderFailedAt: "2026-11-28T04:00:00Z", "x-origin": "test"}
		if n != nil {
			h["x-acquired-count"] = n
		}
		return &amqp091.Delivery{Body: []byte(`{}`), Headers: h}
	}
	first := amqpRecord("orders.dlq", 1, delivery(nil))
	for _, n := range []any{int64(1), int64(2), int32(7)} {
		assert.Equal(t, first.Ref, amqpRecord("orders.dlq", 1, delivery(n)).Ref, "x-acquired-count %v", n)
	}
	r := rec(consumer.HeaderEventID, "e-1")
	out := amqpRedrive(delivery(int64(3)), redriveHeaders(r, time.Now(), ""), "").Headers
	assert.NotContains(t, out, "x-acquired-count")
	assert.Equal(t, "test", out["x-origin"])
}
