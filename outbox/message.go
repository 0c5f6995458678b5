package outbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"

	"github.com/onceco/once/internal/pgtext"
)

// ErrInvalidMessage is wrapped by the errors Add and Statement return for a
// message that could never be published; nothing is written then.
var ErrInvalidMessage = errors.New("outbox: invalid message")

// MaxIDLength is the longest event id Add accepts, in bytes: the consuming
// side of this library dead-letters longer ids by default
// (consumer.Config.Identify.MaxIDLength).
const MaxIDLength = 256

// MaxTopicLength is the longest Topic Add accepts, in bytes: neither broker
// takes a longer name (Kafka's topics have at most 249 characters,
// RabbitMQ's exchanges 255 bytes), and a row the broker refuses is charged
// in an index of its topic and key, whose entries PostgreSQL bounds.
const MaxTopicLength = 255

// MaxKeyLength is the longest Key Add accepts, in bytes. A row the broker
// refuses is charged in place, which enters it in the index of refused
// rows by topic, key and seq: PostgreSQL's index entries hold about
// 2.7 kB, and a longer key failed that charge, written again after every
// backoff for ever, while the relay published nothing else.
const MaxKeyLength = 2048

// Message is one message to publish once the transaction that adds it
// commits.
type Message struct {
	// ID is the event id. It travels as the "id" header on Kafka and as the
	// message-id property on RabbitMQ, which the consuming side of this
	// library reads by default, so that the next hop skips a re-published
	// copy as a duplicate. Empty: Add generates a random UUID (version 4)
	// and stores it, so every publish of the row carries the same id. Set
	// it to derive the id from the event being handled (e.g. ev.ID +
	// "/order.confirmed") when the same business fact must keep one id
	// whatever writes it. At most MaxIDLength bytes of valid UTF-8.
	ID string
	// Topic is the Kafka topic, or the RabbitMQ exchange ("" is RabbitMQ's
	// default exchange, which routes by queue name). Topic and RoutingKey
	// cannot both be empty. At most MaxTopicLength bytes.
	Topic string
	// RoutingKey is the RabbitMQ routing key; the Kafka publisher ignores
	// it.
	RoutingKey string
	// Key orders the messages: the relay publishes the messages of one
	// (Topic, Key) in the order their rows were written, and holds later
	// ones back while an earlier one cannot be published. On Kafka it is
	// also the record key, which picks the partition. Empty: no order is
	// promised and a nil record key is sent. At most MaxKeyLength bytes.
	Key []byte
	// Type is the event type: the "type" header on Kafka and the type
	// property on RabbitMQ, which a consumer.Router dispatches on. Optional.
	Type string
	// Headers are sent with the message, except those of the id and type:
	// on Kafka the publisher sets kafkaout.Config.IDHeader and TypeHeader
	// ("id" and "type" by default) over any header of those names; on
	// RabbitMQ, where the id and type are properties, headers "id" and
	// "type" are dropped. The stored trace context (Add) replaces headers
	// of its names ("traceparent" and "tracestate" by default). RabbitMQ
	// routes by headers "CC" and "BCC", which it takes as arrays only: a
	// row with one is refused by amqpout and parked.
	Headers map[string]string
	// Body is the message value, sent as is.
	Body []byte
}

// Add writes msgs to the default outbox table ("outbox" on the search
// path) in tx; see Store.Add.
func Add(ctx context.Context, tx DB, msgs ...Message) error {
	return defaultStore.Add(ctx, tx, msgs...)
}

// Add writes msgs to the outbox in tx, one statement for all of them. The
// relay publishes them once tx commits, and never if it rolls back. The
// trace context of ctx (the global OpenTelemetry propagator's headers, or
// W3C traceparent when no propagator is set) is stored with each row and
// sent as its headers, so that the next hop's span continues this trace. Add fails with an error wrapping
// ErrInvalidMessage, and writes nothing, if a message has neither Topic
// nor RoutingKey, an ID that is too long or not UTF-8, a Topic longer than
// MaxTopicLength, a Key longer than MaxKeyLength, or an empty header
// name; a database error aborts tx as any failed statement does.
func (s *Store) Add(ctx context.Context, tx DB, msgs ...Message) error {
	if len(msgs) == 0 {
		return nil
	}
	sql, args, err := s.Statement(ctx, msgs...)
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, sql, args...); err != nil {
		return fmt.Errorf("outbox: add: %w", err)
	}
	return nil
}

// Statement returns the statement Add would run for msgs, for a caller
// that sends it with other statements in one round trip: in a consumer
// handler, ev.Queue(sql, args...) queues it with the handler's writes. The
// same validation as Add applies; ids are generated here.
func (s *Store) Statement(ctx context.Context, msgs ...Message) (string, []any, error) {
	if err := s.made(); err != nil {
		return "", nil, err
	}
	n := len(msgs)
	ids, topics, routing, types := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	keys, bodies := make([][]byte, n), make([][]byte, n)
	headers, traces := make([][]byte, n), make([][]byte, n)
	trace, err := traceContext(ctx)
	if err != nil {
		return "", nil, err
	}
	for i, m := range msgs {
		if err := m.validate(); err != nil {
			return "", nil, fmt.Errorf("%w: message %d: %w", ErrInvalidMessage, i, err)
		}
		if m.ID == "" {
			m.ID = newID()
		}
		h, err := json.Marshal(nonNil(m.Headers))
		if err != nil {
			return "", nil, fmt.Errorf("%w: message %d: headers: %w", ErrInvalidMessage, i, err)
		}
		ids[i], topics[i], routing[i], types[i] = m.ID, m.Topic, m.RoutingKey, m.Type
		keys[i], headers[i], traces[i] = nilIfEmpty(m.Key), h, trace
		bodies[i] = m.Body
		if bodies[i] == nil {
			bodies[i] = []byte{}
		}
	}
	return s.insertSQL, []any{ids, topics, routing, keys, types, headers, traces, bodies}, nil
}

// validate reports what makes m unpublishable.
func (m *Message) validate() error {
	if m.Topic == "" && m.RoutingKey == "" {
		return errors.New("neither Topic nor RoutingKey is set")
	}
	if len(m.ID) > MaxIDLength {
		return fmt.Errorf("ID is %d bytes long, more than MaxIDLength (%d)", len(m.ID), MaxIDLength)
	}
	if len(m.Topic) > MaxTopicLength {
		return fmt.Errorf("the Topic is %d bytes long, more than MaxTopicLength (%d): no broker takes a longer name", len(m.Topic), MaxTopicLength)
	}
	if len(m.Key) > MaxKeyLength {
		return fmt.Errorf("the Key is %d bytes long, more than MaxKeyLength (%d): a row the broker refuses is indexed by its key, "+
			"which PostgreSQL's index entries could not hold", len(m.Key), MaxKeyLength)
	}
	for _, s := range []struct{ name, v string }{{"ID", m.ID}, {"Topic", m.Topic}, {"RoutingKey", m.RoutingKey}, {"Type", m.Type}} {
		if !pgtext.Storable(s.v) {
			return fmt.Errorf("%s is not valid UTF-8 text", s.name)
		}
	}
	for k, v := range m.Headers {
		if k == "" {
			return errors.New("a header has an empty name")
		}
		if !pgtext.Storable(k) || !pgtext.Storable(v) {
			return fmt.Errorf("header %q is not valid UTF-8 text", k)
		}
	}
	return nil
}

// traceContext is the JSON of the propagation headers of ctx's span:
// those of the global propagator, or, when it writes none (it is a no-op
// until a service sets one), W3C traceparent and tracestate, which the
// consumer of the next hop reads without a propagator too.
func traceContext(ctx context.Context) ([]byte, error) {
	carrier := propagation.MapCarrier{}
	otel.GetTextMapPropagator().Inject(ctx, carrier)
	if len(carrier) == 0 {
		propagation.TraceContext{}.Inject(ctx, carrier)
	}
	return json.Marshal(map[string]string(carrier))
}

// newID is a random UUID, version 4.
func newID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	var out [36]byte
	hex.Encode(out[0:8], b[0:4])
	out[8] = '-'
	hex.Encode(out[9:13], b[4:6])
	out[13] = '-'
	hex.Encode(out[14:18], b[6:8])
	out[18] = '-'
	hex.Encode(out[19:23], b[8:10])
	out[23] = '-'
	hex.Encode(out[24:], b[10:])
	return string(out[:])
}

func nonNil(h map[string]string) map[string]string {
	if h == nil {
		return map[string]string{}
	}
	return h
}

func nilIfEmpty(b []byte) []byte {
	if len(b) == 0 {
		return nil
	}
	return b
}
