package amqp

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/big"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"

	"github.com/onceco/once/consumer"
)

// Headers written on dead-letter copies in addition to the consumer's
// diagnostic headers (consumer.DeadLetter.Headers).
const (
	// HeaderOriginalExchange is the exchange the message was published to
	// ("" for the default exchange).
	HeaderOriginalExchange = "once-original-exchange"
	// HeaderOriginalRoutingKey is the routing key it was published with.
	HeaderOriginalRoutingKey = "once-original-routing-key"
	// HeaderOriginalQueue is the queue the source consumed it from.
	HeaderOriginalQueue = "once-original-queue"
	// HeaderOriginalExpiration holds the message's expiration property,
	// which is not copied (the copy must not expire from the DLQ).
	HeaderOriginalExpiration = "once-original-expiration"
	// HeaderOriginalUserID holds the message's user-id property, which is
	// not copied (RabbitMQ rejects a user-id other than the publisher's).
	HeaderOriginalUserID = "once-original-user-id"
	// HeaderOriginalCC holds the message's CC header (sender-selected
	// distribution: more routing keys), which is not copied: the broker
	// would route the copy by it too, into other queues, or back into
	// the source queue to fail and be dead-lettered again without end.
	// once dlq replay restores it.
	HeaderOriginalCC = "once-original-cc"
)

// ccHeader is the header RabbitMQ routes a message by besides its routing
// key (sender-selected distribution). BCC is removed by the broker before
// delivery.
const ccHeader = "CC"

// FallbackIDPrefix starts every Message.FallbackID of this adapter.
const FallbackIDPrefix = "amqp-sha256:"

// DeliveryCountHeader is the header in which quorum queues count earlier
// deliveries; it is reported as Message.DeliveryCount on a redelivery (on
// a first delivery it is the publisher's, not the broker's).
const DeliveryCountHeader = "x-delivery-count"

// delivery is one AMQP delivery; it implements consumer.Delivery.
type delivery struct {
	src   *Source
	sess  *session
	acked atomic.Bool
	// d and msg are held by value: one allocation per delivery instead
	// of three (the amqp091.Delivery received, the Message, this).
	d   amqp091.Delivery
	msg consumer.Message
}

// TelemetryAttributes implements consumer.TelemetryAttributer, as the
// OpenTelemetry messaging conventions name a RabbitMQ consumer's
// destination: messaging.destination.name is
// "{exchange}:{routing key}:{queue}", an empty part (the default exchange,
// no routing key) left out and a routing key equal to the queue given
// once. A message published to the default exchange with the queue's name
// as its routing key thus has the queue as its destination, the
// messaging.destination.name of the consumer's metrics, which keep the
// queue for every message: the routing key may not have the low
// cardinality the conventions ask of a metric's attributes. The routing
// key, when not empty, is messaging.rabbitmq.destination.routing_key; the
// queue consumed from is messaging.destination.subscription.name.
func (d *delivery) TelemetryAttributes() []attribute.KeyValue {
	queue, key := d.msg.Topic, d.d.RoutingKey
	name := queue
	if key != "" && key != queue {
		name = key + ":" + name
	}
	if d.d.Exchange != "" {
		name = d.d.Exchange + ":" + name
	}
	attrs := make([]attribute.KeyValue, 0, 3)
	attrs = append(attrs,
		attribute.String("messaging.destination.name", name),
		attribute.String("messaging.destination.subscription.name", queue))
	if key != "" {
		attrs = append(attrs, attribute.String("messaging.rabbitmq.destination.routing_key", key))
	}
	return attrs
}

func (s *Source) newDelivery(sess *session, d amqp091.Delivery) *delivery {
	dv := &delivery{src: s, sess: sess, d: d}
	dv.msg = consumer.Message{
		ID:            d.MessageId,
		Type:          d.Type,
		Key:           []byte(d.RoutingKey),
		Value:         d.Body,
		Headers:       headerStrings(d.Headers),
		Topic:         s.cfg.Queue,
		Partition:     -1,
		Offset:        -1,
		Timestamp:     d.Timestamp,
		Redelivered:   d.Redelivered,
		DeliveryCount: brokersDeliveryCount(d),
	}
	if s.cfg.Ordered {
		dv.msg.Stream = s.cfg.Queue
	}
	if s.cfg.FallbackID {
		dv.msg.FallbackID = fallbackID(d.Exchange, d.RoutingKey, d.Type, d.Body)
	}
	return dv
}

// Message returns the message. Message.ID is the message-id property,
// Message.Type the type property, Message.Key the routing key it was
// published with, Message.Headers the AMQP headers as strings,
// Message.Topic the queue, Message.Stream empty (or the queue with
// Config.Ordered).
func (d *delivery) Message() *consumer.Message { return &d.msg }

// Context is done once the delivery's channel closed (connection lost,
// channel error, source closed).
func (d *delivery) Context() context.Context { return d.sess.ctx }

// Ack acknowledges the delivery on the channel it came from. It returns an
// error wrapping ErrChannelClosed, and acks nothing, when that channel
// closed, or when its session is being closed (Close, a consumer the
// broker cancelled) and has sent its last acks; the broker then delivers
// the message again.
//
// The ack frame is sent right after Ack returns, by a goroutine of the
// session that coalesces consecutive acks into one frame with the multiple
// flag (never covering a delivery whose Ack was not called). Acks still
// unsent when the channel dies are lost like any ack in flight: the broker
// delivers those messages again and the consumer skips them as
// duplicates. Close sends every pending ack before closing the connection.
func (d *delivery) Ack(ctx context.Context) error {
	if d.sess.ctx.Err() != nil {
		return fmt.Errorf("amqp: ack delivery %d: %w (%w)", d.d.DeliveryTag, ErrChannelClosed, context.Cause(d.sess.ctx))
	}
	if d.sess.ch.IsClosed() {
		return fmt.Errorf("amqp: ack delivery %d: %w", d.d.DeliveryTag, ErrChannelClosed)
	}
	if !d.acked.CompareAndSwap(false, true) {
		return fmt.Errorf("amqp: delivery %d acked twice", d.d.DeliveryTag)
	}
	if !d.sess.acker.ack(d.d.DeliveryTag) {
		// The session is closing, and its last acks were sent.
		d.acked.Store(false)
		return fmt.Errorf("amqp: ack delivery %d: %w (the session was closing)", d.d.DeliveryTag, ErrChannelClosed)
	}
	return nil
}

// DeadLetter publishes a copy of the message to the dead-letter exchange
// and routing key of the Config: the original body and properties (except
// expiration and user-id, kept in headers), persistent, with the original
// headers (but CC, kept as HeaderOriginalCC) overwritten by dl.Headers and
// the once-original-exchange, once-original-routing-key and
// once-original-queue headers.
//
// A copy whose properties would not fit one frame (the connection's
// frame_max: a content header cannot be split) is shaped to fit first: its
// diagnostic headers cut (HeaderDiagnosticsCut), then the original headers
// dropped (HeaderOriginalDropped); the body is kept whole. The original
// headers are dropped too when, with the copy's own, they would be more
// entries than amqp091 reads in one table (8192): no amqp091 client, once
// dlq included, could read the copy. A body the broker refuses as larger
// than its max_message_size (lowered since the message was published) is
// dropped, and the copy written again without it (HeaderValueDropped):
// the body is then lost once the delivery is acked.
//
// It returns once the broker confirmed the copy, and an error when it
// nacked it (a queue refused it: a full dead-letter queue with x-overflow
// reject-publish, logged at level Error), the copy was unroutable, no
// confirm came within Config.ConfirmTimeout, the broker blocks the
// dead-letter connection (ErrPublisherBlocked), or the delivery's channel
// closed. A copy the
// broker refuses with ACCESS_REFUSED (no permission to publish to the
// exchange, or an internal exchange), which no retry cures until it is
// fixed on the broker, is logged at level Error with the exchange and
// counted in DeadLetterRefusalsMetric; the error then wraps the broker's
// *amqp091.Error. So is a copy the broker nacks: a queue refused it, most
// often a dead-letter queue full under x-overflow reject-publish, which
// refuses every copy until it is drained. A destination found missing
// (its exchange deleted, or no queue bound to take the copy) is declared
// again before the next attempt, except with Config.Passive or
// DeadLetter.NoQueue, where the source declares nothing that would bring
// it back: such a failure is logged at level Error and counted too. The
// copy goes out on the source's dead-letter connection, not the consuming
// one. It does not ack the delivery. A nil dl is refused with an error.
func (d *delivery) DeadLetter(ctx context.Context, dl *consumer.DeadLetter) error {
	if dl == nil {
		// A copy that says nothing of why would be written, then acked:
		// refused, as the Kafka source refuses it.
		return fmt.Errorf("amqp: dead-letter delivery %d: DeadLetter called with a nil *consumer.DeadLetter", d.d.DeliveryTag)
	}
	if d.sess.ctx.Err() != nil {
		return fmt.Errorf("amqp: dead-letter delivery %d: %w (%w)", d.d.DeliveryTag, ErrChannelClosed, context.Cause(d.sess.ctx))
	}
	cfg := &d.src.cfg
	c := &deadLetterCopy{d: &d.d, diag: dl.Headers(&d.msg), queue: cfg.Queue}
	err := d.src.pub.publish(ctx, d, cfg.DeadLetter.Exchange, cfg.DeadLetter.RoutingKey, c.publishing, cfg.ConfirmTimeout)
	if limit := maxBodySize(err); limit > 0 && len(d.d.Body) > limit {
		// A body the broker will not take again (max_message_size was
		// lowered since it was published): a copy that can never be
		// written would hold the message forever. Write the copy
		// without it.
		d.src.log.Error("amqp: dead-letter copy's body is larger than the broker's max_message_size; writing the copy without it, the body is lost",
			"event_id", cutText(dl.EventID, 256), "body_bytes", len(d.d.Body), "max_message_size", limit)
		c.dropBody = true
		err = d.src.pub.publish(ctx, d, cfg.DeadLetter.Exchange, cfg.DeadLetter.RoutingKey, c.publishing, cfg.ConfirmTimeout)
	}
	if accessRefused(err) {
		// No permission to publish to the exchange, an internal one, or
		// the dead-letter connection's credentials refused: every retry is
		// refused the same until it is fixed on the broker.
		d.src.refusals.Add(ctx, 1, d.src.attrs)
		d.src.log.Error("amqp: the broker refuses the dead-letter copies (ACCESS_REFUSED: no permission to publish to the exchange, an internal exchange, "+
			"or the credentials refused); the message stays unacked and is retried until that is fixed on the broker",
			"exchange", cfg.DeadLetter.Exchange, "routing_key", cfg.DeadLetter.RoutingKey, "event_id", cutText(dl.EventID, 256), "error", err)
		return err
	}
	if errors.Is(err, errNacked) {
		// A queue refused the copy: a full dead-letter queue under
		// x-overflow reject-publish refuses every retry until someone
		// drains it, which nothing in a passing warning would tell.
		d.src.refusals.Add(ctx, 1, d.src.attrs)
		d.src.log.Error("amqp: the broker nacked the dead-letter copy: a queue it routes to refused it (a dead-letter queue at its x-max-length "+
			"or x-max-length-bytes with x-overflow reject-publish, or a copy larger than its x-max-length-bytes, or a quorum queue without a majority); "+
			"the message stays unacked and is retried until that queue takes it: drain the dead-letter queue (once dlq replay) or raise its limit",
			"exchange", cfg.DeadLetter.Exchange, "routing_key", cfg.DeadLetter.RoutingKey, "dead_letter_queue", cfg.DeadLetter.Queue,
			"event_id", cutText(dl.EventID, 256), "error", err)
		return err
	}
	if (cfg.Passive || cfg.DeadLetter.NoQueue) && destinationMissing(err) {
		// Declared again on the next attempt otherwise; here nothing
		// the source does brings it back.
		d.src.refusals.Add(ctx, 1, d.src.attrs)
		d.src.log.Error("amqp: the dead-letter destination is missing (the exchange, or a queue bound to it with the routing key), "+
			"and the source declares no such queue (Config.Passive, Config.DeadLetter.NoQueue); the message stays unacked and is "+
			"retried until the topology is restored on the broker",
			"exchange", cfg.DeadLetter.Exchange, "routing_key", cfg.DeadLetter.RoutingKey, "event_id", cutText(dl.EventID, 256), "error", err)
		return err
	}
	if err != nil {
		d.src.log.Warn("amqp: dead-letter publish failed", "event_id", cutText(dl.EventID, 256), "error", err)
		return err
	}
	if c.shaped() {
		d.src.log.Warn("amqp: dead-letter copy too large for a frame, or with more headers than a client reads; written with its headers cut",
			"event_id", cutText(dl.EventID, 256), "frame_max", c.frameMax,
			"diagnostics_cut", strings.Join(c.cut, ","), "original_header_bytes_dropped", c.originalDropped)
	}
	return nil
}

// fallbackID hashes what identifies a message when it carries no id. The
// type property is part of it: two events of different types may share a
// body ({"order_id": 7} created, then cancelled).
func fallbackID(exchange, routingKey, typ string, body []byte) string {
	h := sha256.New()
	h.Write([]byte(exchange))
	h.Write([]byte{0})
	h.Write([]byte(routingKey))
	h.Write([]byte{0})
	h.Write([]byte(typ))
	h.Write([]byte{0})
	h.Write(body)
	return FallbackIDPrefix + hex.EncodeToString(h.Sum(nil))
}

// brokersDeliveryCount is the x-delivery-count of d when the broker wrote
// it: on a redelivery. A quorum queue sets the header (and the redelivered
// flag) only on a message delivered before, and leaves the header a
// message was published with as it is on its first delivery: a copy
// republished from a quorum queue by an application or a shovel (or a
// dead letter of this source, which keeps the original headers) carries
// the count of another queue, and would have the consumer take every such
// first delivery for a redelivery, run alone with a crash-guard write.
// Classic queues never set it.
func brokersDeliveryCount(d amqp091.Delivery) int {
	if !d.Redelivered {
		return 0
	}
	return deliveryCount(d.Headers)
}

// deliveryCount reads x-delivery-count, whatever integer type it has.
func deliveryCount(h amqp091.Table) int {
	v, ok := h[DeliveryCountHeader]
	if !ok {
		return 0
	}
	switch n := v.(type) {
	case int8:
		return int(n)
	case int16:
		return int(n)
	case int32:
		return int(n)
	case int64:
		return int(n)
	case int:
		return n
	case uint8:
		return int(n)
	case uint16:
		return int(n)
	case uint32:
		return int(n)
	case uint64:
		if n > math.MaxInt32 {
			return math.MaxInt32
		}
		return int(n)
	case string:
		c, err := strconv.Atoi(n)
		if err != nil {
			return 0
		}
		return c
	}
	return 0
}

// headerStrings converts an AMQP header table to strings: strings and byte
// arrays as they are, numbers and booleans formatted, timestamps in
// RFC 3339, decimals exactly, nested tables and arrays as JSON. Void
// values become "".
func headerStrings(t amqp091.Table) map[string]string {
	if len(t) == 0 {
		return map[string]string{}
	}
	out := make(map[string]string, len(t))
	for k, v := range t {
		out[k] = HeaderString(v)
	}
	return out
}

// HeaderString renders one AMQP header value as the consumer sees it in
// consumer.Message.Headers: strings and byte arrays as they are, numbers
// and booleans formatted, timestamps in RFC 3339, decimals exactly, nested
// tables and arrays as JSON, a void value as "". Tools that show headers
// (the once command's dead-letter listing) use it to show the same text.
func HeaderString(v any) string {
	switch x := v.(type) {
	case nil:
		return ""
	case string:
		return x
	case []byte:
		return string(x)
	case bool:
		return strconv.FormatBool(x)
	case int8:
		return strconv.FormatInt(int64(x), 10)
	case int16:
		return strconv.FormatInt(int64(x), 10)
	case int32:
		return strconv.FormatInt(int64(x), 10)
	case int64:
		return strconv.FormatInt(x, 10)
	case int:
		return strconv.Itoa(x)
	case uint8:
		return strconv.FormatUint(uint64(x), 10)
	case uint16:
		return strconv.FormatUint(uint64(x), 10)
	case uint32:
		return strconv.FormatUint(uint64(x), 10)
	case uint64:
		return strconv.FormatUint(x, 10)
	case float32:
		return strconv.FormatFloat(float64(x), 'g', -1, 32)
	case float64:
		return strconv.FormatFloat(x, 'g', -1, 64)
	case time.Time:
		return x.UTC().Format(time.RFC3339)
	case amqp091.Decimal:
		return decimalString(x)
	case amqp091.Table, []any:
		b, err := json.Marshal(jsonValue(x))
		if err != nil {
			return fmt.Sprint(x)
		}
		return string(b)
	default:
		return fmt.Sprint(x)
	}
}

// jsonValue makes nested header values JSON-friendly: byte arrays as
// strings, decimals and timestamps as their header strings.
func jsonValue(v any) any {
	switch x := v.(type) {
	case amqp091.Table:
		m := make(map[string]any, len(x))
		for k, e := range x {
			m[k] = jsonValue(e)
		}
		return m
	case []any:
		a := make([]any, len(x))
		for i, e := range x {
			a[i] = jsonValue(e)
		}
		return a
	case []byte, time.Time, amqp091.Decimal:
		return HeaderString(x)
	case float32:
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			return HeaderString(x)
		}
		return x
	case float64:
		if math.IsNaN(x) || math.IsInf(x, 0) {
			return HeaderString(x)
		}
		return x
	default:
		return x
	}
}

func decimalString(d amqp091.Decimal) string {
	r := new(big.Rat).SetFrac(big.NewInt(int64(d.Value)), new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(d.Scale)), nil))
	return r.FloatString(int(d.Scale))
}
