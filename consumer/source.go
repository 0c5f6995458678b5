package consumer

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"
)

// Message is one broker message as an adapter hands it to the consumer.
// Adapters fill the fields they know; the consumer never modifies a Message.
type Message struct {
	// ID is the event id carried by a broker-native property (AMQP's
	// message-id). Empty when the broker has no such property or it is
	// unset; the consumer then looks in Headers, the envelope and FallbackID.
	ID string
	// Type is the event type carried by a broker-native property (AMQP's
	// type). Empty when absent; the consumer then looks in Headers and the
	// envelope.
	Type string
	// FallbackID is an id the adapter can derive when the event carries
	// none, stable across redeliveries of the same message: Kafka uses
	// "topic/partition/offset@topic-id" (the topic id from Kafka 2.8 on,
	// so that a re-created topic's records are not taken for the old
	// one's); the AMQP adapter, only when its Config.FallbackID opts in, a
	// hash of exchange, routing key, type and body. Empty when the adapter
	// has no safe fallback (AMQP by default), in which case an event
	// without an id is dead-lettered with kind KindMissingID.
	FallbackID string

	// Key is the message's key: the Kafka record key, the AMQP routing key.
	Key []byte
	// Value is the payload, as the broker delivered it: what the Decoder
	// (or the Envelope) reads, and what the fingerprint hashes by default.
	Value []byte
	// Headers are the message's headers as strings, where the consumer
	// looks for the event id and type (Config.Identify.IDHeaders and
	// TypeHeaders) and for the producer's trace context.
	Headers map[string]string

	// Topic is the Kafka topic or the AMQP queue the message was read from.
	Topic string
	// Partition is the Kafka partition; -1 where the broker has none.
	Partition int32
	// Offset is the Kafka offset; -1 where the broker has none.
	Offset int64
	// Timestamp is the producer or broker timestamp; zero when unknown.
	Timestamp time.Time

	// Stream names the ordering lane of the message. Deliveries with the
	// same non-empty Stream are handled one after another, in the order
	// Receive returned them, and acked in that order; Kafka uses
	// "topic/partition", and AMQP with Config.Ordered the queue's name. An
	// empty Stream means no order is promised and the delivery may be
	// handled concurrently with any other (AMQP by default).
	Stream string

	// Redelivered reports that the broker says this message may have been
	// delivered before (AMQP's redelivered flag). The consumer records a
	// durable attempt for such messages so that one that crashes the
	// process every time is dead-lettered after Config.CrashGuard.MaxCrashes.
	Redelivered bool
	// DeliveryCount is the broker's count of earlier deliveries (the
	// x-delivery-count header of RabbitMQ quorum queues); 0 when unknown.
	DeliveryCount int
}

// Delivery is one received message plus the means to settle it. The
// consumer calls exactly one of these sequences for every delivery it
// handles: Ack; or DeadLetter then (after it succeeded) Ack; or nothing,
// when the delivery is abandoned (shutdown, revoked partition, closed
// channel) and the broker will deliver it again.
//
// Ack and DeadLetter may be called from any goroutine, concurrently for
// different deliveries. For deliveries of one Stream they are called in the
// order Receive returned the deliveries.
//
// Message and Context (and DeduplicatedByPosition, for a
// PositionDeduplicated delivery) are called once, on the goroutine that
// calls Receive, just after Receive returned the delivery; the consumer
// keeps their answers and never calls them again. A nil answer of Message
// or Context, or a panic in one of them, stops Run with an error wrapping
// ErrSourceBroken, the delivery left unsettled.
type Delivery interface {
	// Message returns the message. It is never nil.
	Message() *Message
	// Context is done when the delivery can no longer be acknowledged: its
	// Kafka partition was revoked or its AMQP channel closed. The consumer
	// stops work on a delivery whose context is done and does not settle it.
	// Its cause is ErrDeliveryTimedOut when the broker took the delivery
	// back for staying unacknowledged too long.
	//
	// The context must be comparable (==), as the standard library's
	// contexts are: a context of a type that cannot be compared (a struct
	// value holding a map) stops Run with an error wrapping
	// ErrSourceBroken. So does a context whose Done, Err or Value panics
	// when the consumer tries them, as it first receives the context: the
	// consumer calls them on its workers' goroutines, where a panic would
	// end the process (one that panics only later, once the context is
	// done, still does). Deliveries of one assignment of a stream (one
	// partition claim, one channel) share one context, and a new
	// assignment has a new one: the consumer takes a new context on a
	// stream as the sign that earlier work may have died with a previous
	// owner, and counts crash attempts for the first messages after it
	// (Config.CrashGuard.MaxCrashes).
	Context() context.Context
	// Ack settles the delivery: commits or marks the Kafka offset, acks the
	// AMQP delivery. It is called only after the transaction that handled
	// the message (or recognised it as a duplicate) committed, or after
	// DeadLetter succeeded. When the delivery can no longer be settled
	// (revoked, channel closed) Ack returns an error and settles nothing;
	// the consumer logs it, and the broker's redelivery is then skipped as
	// a duplicate. ctx is not done with the delivery's context or the
	// message's batch, but at the consumer's shutdown deadline: an Ack
	// that waits on something (a database write) ends by then. A panic in
	// Ack is recovered and taken as an Ack that returned an error.
	Ack(ctx context.Context) error
	// DeadLetter writes a copy of the message (original key, value and
	// headers) with the diagnostic headers of dl.Headers to the adapter's
	// dead-letter destination and returns only once the broker has
	// confirmed the write. It must not settle the delivery: the consumer
	// calls Ack afterwards. An error means the copy may not exist; the
	// consumer retries with backoff and never acks in between. A panic in
	// DeadLetter is recovered and taken as such an error (wrapping
	// ErrSourceBroken, with the panic's value and stack); SourcePanicLimit
	// panics in a row for one message stop Run. The consumer never passes
	// a nil dl; the adapters of this module refuse one with an error.
	DeadLetter(ctx context.Context, dl *DeadLetter) error
}

// Source is the adapter contract: a stream of deliveries from one
// subscription (a Kafka consumer group on some topics, an AMQP queue).
//
// Receive is called from a single goroutine. It blocks until a delivery is
// available or ctx is done (then it returns ctx.Err()). Transient broker
// failures (a lost connection, a rebalance) are the adapter's to absorb:
// Receive keeps blocking while it reconnects. A non-nil error other than
// ctx.Err() is fatal and stops the consumer; so is a Receive that returns
// a nil delivery with a nil error, or a delivery whose Message or Context
// is nil or panics, or whose Context cannot be compared, or panics itself:
// Run then returns an error wrapping ErrSourceBroken.
//
// Close is called once, after the consumer stopped calling Receive and every
// Ack and DeadLetter call returned. It flushes pending acknowledgements
// (Kafka offset commits) and releases the connection. Run returns its
// error, joined with any other; a panic in Close is taken as such an error,
// wrapping ErrSourceBroken. When Run stops before it started (the store
// could not be prepared), Close's error is dropped.
type Source interface {
	Receive(ctx context.Context) (Delivery, error)
	Close() error
}

// SystemNamer is implemented by sources that tell telemetry which messaging
// system they read from, as the OpenTelemetry messaging.system attribute
// ("kafka", "rabbitmq"). The consumer finds it by type assertion and asks
// it once, in New; a panic in it makes New fail with an error wrapping
// ErrSourceBroken.
type SystemNamer interface {
	MessagingSystem() string
}

// StreamBounder is implemented by sources that bound by themselves, for
// each stream, the deliveries they have handed out and that are not
// settled yet, as the Kafka adapter bounds each partition's
// (MaxPendingPerPartition). The consumer then queues their streams'
// deliveries without Config.ReceiveBuffer's bound: with it, one stream
// stuck behind a message (a handler that does not return, a retry far
// away, a dead-letter destination that refuses the copy) filled the
// buffer with its backlog, and receiving, which the source's streams
// share, stopped for all the others. The consumer finds it by type
// assertion and asks it once, in New; a panic in it makes New fail with
// an error wrapping ErrSourceBroken.
type StreamBounder interface {
	// BoundsStreams reports whether the source bounds each stream's
	// unsettled deliveries.
	BoundsStreams() bool
}

// DeliveryLimiter is implemented by sources whose broker takes a message
// away by itself once it has delivered it again a number of times, as a
// RabbitMQ quorum queue's x-delivery-limit does (to the queue's own
// dead-letter exchange, or dropped without one). The crash guard needs a
// message that crashes the process every time to be delivered again
// Config.CrashGuard.MaxCrashes times after its first delivery, and once
// more, to dead-letter it with kind KindCrashLoop and its diagnostic
// headers: with a limit at or below MaxCrashes the broker takes the
// message first. New asks once and logs a warning then; a panic in it
// makes New fail with an error wrapping ErrSourceBroken.
type DeliveryLimiter interface {
	// DeliveryLimit returns how many times the broker delivers a message
	// again before it takes it away; 0 for no limit, or none known.
	DeliveryLimit() int64
}

// ErrSourceBroken is wrapped by the error Run returns when its Source
// broke the contract: Receive returned a nil delivery with a nil error, or
// a delivery whose Message or Context is nil or whose Context cannot be
// compared, or Receive panicked, or the
// delivery's Message, Context or DeduplicatedByPosition did (the error
// then holds the panic's value and stack). Run stops as on any other fatal
// Receive error; the deliveries it did not settle, the broken one among
// them, are left to the broker to deliver again. It is also wrapped by the
// error of a panic in Delivery.Ack or Delivery.DeadLetter, which is that
// call's failure and does not stop Run; by Run's error when
// RecordProgress, FirstPositionDone or DeadLetter panicked
// SourcePanicLimit times in a row on the same work, or when the source's
// Close panicked; and by New's when its MessagingSystem, ConsumerGroup,
// BoundsStreams or DeliveryLimit did.
var ErrSourceBroken = errors.New("once: the source broke its contract")

// ErrSourceClosed is returned by Receive once the source has been closed.
var ErrSourceClosed = errors.New("once: source closed")

// ErrDeliveryTimedOut is what a Source makes the cause (context.Cause) of a
// delivery's context, wrapped or as it is, when the broker took the
// delivery back because it stayed unacknowledged too long (RabbitMQ's
// consumer_timeout): the handling outlasted what the broker allows. A
// suspect (Config.CrashGuard) whose run is cut so before its handler
// returned is charged that run as a crash, so that a handler that always
// outlasts the broker's limit is dead-lettered KindCrashLoop instead of
// being redelivered for ever. A delivery lost for any other cause (a lost
// connection, a revoked partition) is never charged to its message.
var ErrDeliveryTimedOut = errors.New("once: the broker took the delivery back: unacknowledged too long")

// ErrorKind says why a message was dead-lettered. It is written to the DLQ
// record's HeaderErrorKind header.
type ErrorKind string

// The kinds of dead-lettering.
const (
	// KindDecode: the value (or its envelope) could not be decoded.
	KindDecode ErrorKind = "decode"
	// KindHandler: the handler failed permanently or past the retry policy.
	KindHandler ErrorKind = "handler"
	// KindPanic: the handler panicked on every attempt; the stack is in
	// HeaderErrorStack.
	KindPanic ErrorKind = "panic"
	// KindUnknownType: no handler is registered for the event type and the
	// router's policy is to dead-letter.
	KindUnknownType ErrorKind = "unknown-type"
	// KindMissingID: the event carries no id and the adapter has no fallback.
	KindMissingID ErrorKind = "missing-id"
	// KindInvalidID: the event id is longer than Config.Identify.MaxIDLength or not
	// valid UTF-8.
	KindInvalidID ErrorKind = "invalid-id"
	// KindIDConflict: the id was processed before with a different payload
	// fingerprint.
	KindIDConflict ErrorKind = "id-conflict"
	// KindCrashLoop: handling the message crashed or stalled the process,
	// or lost its transaction's database session while it ran alone,
	// Config.CrashGuard.MaxCrashes times.
	KindCrashLoop ErrorKind = "crash-loop"
)

// Diagnostic header names written on dead-letter copies. Adapters write
// the original headers first and these over them.
const (
	HeaderOriginalTopic     = "once-original-topic"
	HeaderOriginalPartition = "once-original-partition"
	HeaderOriginalOffset    = "once-original-offset"
	HeaderOriginalTimestamp = "once-original-timestamp"
	HeaderConsumer          = "once-consumer"
	HeaderEventID           = "once-event-id"
	HeaderEventType         = "once-event-type"
	HeaderAttempts          = "once-attempts"
	HeaderErrorKind         = "once-error-kind"
	HeaderErrorMessage      = "once-error-message"
	HeaderErrorStack        = "once-error-stack"
	// HeaderErrorSQLState is the SQLSTATE of a PostgreSQL error that
	// dead-lettered the message, when one did.
	HeaderErrorSQLState = "once-error-sqlstate"
	HeaderFailedAt      = "once-failed-at"
	// HeaderFingerprint and HeaderOriginalFingerprint (hex) and
	// HeaderOriginalProcessedAt are written on KindIDConflict copies.
	HeaderFingerprint         = "once-fingerprint"
	HeaderOriginalFingerprint = "once-original-fingerprint"
	HeaderOriginalProcessedAt = "once-original-processed-at"
	// HeaderTraceParent carries the W3C trace context of the span that
	// dead-lettered the message.
	HeaderTraceParent = "traceparent"
	// HeaderFallbackID is the message's Message.FallbackID (Kafka's
	// topic/partition/offset@topic-id), or, for a redriven record, its
	// first delivery's (HeaderRedriveFallbackID). Absent when the adapter
	// gives none. A redrive carries it back as HeaderRedriveFallbackID, so
	// that every consumer whose id for the record is its position finds the
	// same id on the copy.
	HeaderFallbackID = "once-fallback-id"
)

// Headers a redrive (a dead-lettered record put back on its original
// topic or exchange) writes over the record's original headers.
const (
	// HeaderRedriveEventID carries the event id the record had when it was
	// dead-lettered. For the consumer that dead-lettered it
	// (HeaderRedriveConsumer; every consumer when that header is absent),
	// identification prefers it over every other source (Message.ID,
	// Config.Identify.IDHeaders, the envelope, Config.Identify.EventID and
	// the adapter's fallback), so a redriven record is deduplicated against
	// its first delivery even when that id was derived from a Kafka position
	// the copy no longer has.
	HeaderRedriveEventID = "once-redrive-event-id"
	// HeaderRedriveConsumer names the consumer (Config.Name) whose dead
	// letter was redriven. The record goes back to its topic or exchange,
	// where other consumers may read it too: they identify it their own way,
	// as they did its first delivery, so a copy of a record they handled is
	// their duplicate.
	HeaderRedriveConsumer = "once-redrive-consumer"
	// HeaderRedriveFallbackID is the first delivery's Message.FallbackID
	// (HeaderFallbackID of the dead letter). Identification uses it in
	// place of the copy's own FallbackID, the copy's position.
	HeaderRedriveFallbackID = "once-redrive-fallback-id"
	// HeaderRedriveCount is how many times the record has been redriven.
	HeaderRedriveCount = "once-redrive-count"
	// HeaderRedrivenAt is when the last redrive published it (RFC 3339).
	HeaderRedrivenAt = "once-redriven-at"
	// HeaderRedrivenBy names who asked for the last redrive, when given.
	HeaderRedrivenBy = "once-redriven-by"
)

// maxHeaderText bounds error messages and stacks written as headers, so a
// huge error cannot make the dead-letter copy exceed the broker's limits.
const maxHeaderText = 4096

// DeadLetter describes why a message is being dead-lettered.
type DeadLetter struct {
	// Kind says why: KindHandler, KindDecode, KindPanic, ...
	Kind ErrorKind
	// Error is the failure's message; Headers cuts it to 4096 bytes.
	Error string
	// Stack is the panic's stack (KindPanic only); Headers cuts it to
	// 4096 bytes.
	Stack string
	// Consumer is the consumer's Config.Name.
	Consumer string
	// EventID and EventType are the event's id and type; empty when there
	// is none (KindMissingID has no id).
	EventID   string
	EventType string
	// Attempts is how many times the handler ran: 0 for id failures and a
	// Decoder's or Envelope's failure (also one retried with RetryAfter
	// until Retry.MaxAttempts, whose Error names how often it failed, as an
	// Identify.EventID's is); a KindDecode dead letter of a handler that
	// returned a DecodeError counts its run.
	Attempts int
	// FailedAt is when the consumer dead-lettered the message.
	FailedAt time.Time
	// TraceParent is the W3C traceparent of the consumer span; empty when
	// tracing is off.
	TraceParent string
	// Extra holds kind-specific diagnostics, e.g. the fingerprints of an
	// id conflict. Its keys are header names.
	Extra map[string]string
}

// Headers returns the diagnostic headers for a dead-letter copy of m. The
// adapter adds its broker-specific ones (exchange, routing key) and writes
// them over the message's original headers. A nil dl reads as the zero
// DeadLetter (no kind, no error), and a nil m adds none of the message's
// headers (position, timestamp, fallback id): neither panics, though the
// consumer never passes either, and the adapters refuse a nil dl.
func (dl *DeadLetter) Headers(m *Message) map[string]string {
	if dl == nil {
		dl = &DeadLetter{}
	}
	h := make(map[string]string, 16+len(dl.Extra))
	if m != nil {
		originHeaders(h, m)
	}
	h[HeaderConsumer] = dl.Consumer
	h[HeaderEventID] = dl.EventID
	h[HeaderEventType] = dl.EventType
	h[HeaderAttempts] = strconv.Itoa(dl.Attempts)
	h[HeaderErrorKind] = string(dl.Kind)
	h[HeaderErrorMessage] = truncate(dl.Error, maxHeaderText)
	if dl.Stack != "" {
		h[HeaderErrorStack] = truncate(dl.Stack, maxHeaderText)
	}
	h[HeaderFailedAt] = dl.FailedAt.UTC().Format(time.RFC3339Nano)
	if dl.TraceParent != "" {
		h[HeaderTraceParent] = dl.TraceParent
	}
	for k, v := range dl.Extra {
		h[k] = v
	}
	return h
}

// originHeaders writes into h the headers of m, the message a dead letter
// copies: its position, timestamp and fallback id.
func originHeaders(h map[string]string, m *Message) {
	h[HeaderOriginalTopic] = m.Topic
	if m.Partition >= 0 {
		h[HeaderOriginalPartition] = strconv.FormatInt(int64(m.Partition), 10)
	}
	if m.Offset >= 0 {
		h[HeaderOriginalOffset] = strconv.FormatInt(m.Offset, 10)
	}
	if !m.Timestamp.IsZero() {
		h[HeaderOriginalTimestamp] = m.Timestamp.UTC().Format(time.RFC3339Nano)
	}
	if fb := fallbackID(m); fb != "" {
		h[HeaderFallbackID] = fb
	}
}

// fallbackID is m's fallback id: its first delivery's when m is a redriven
// copy (HeaderRedriveFallbackID), else Message.FallbackID.
func fallbackID(m *Message) string {
	if fb := m.Headers[HeaderRedriveFallbackID]; fb != "" {
		return fb
	}
	return m.FallbackID
}

// redriveEventID is the id m was dead-lettered under when m is a redriven
// copy of this consumer's own dead letter; empty for a copy of another
// consumer's (it identifies the record its own way) and for a record that
// was never redriven.
func redriveEventID(m *Message, consumer string) string {
	if owner := m.Headers[HeaderRedriveConsumer]; owner != "" && owner != consumer {
		return ""
	}
	return m.Headers[HeaderRedriveEventID]
}

// ownRedrive reports whether m is a redriven copy of this consumer's own
// dead letter (HeaderRedriveConsumer names it).
func ownRedrive(m *Message, consumer string) bool {
	return m.Headers[HeaderRedriveConsumer] == consumer
}

// truncate cuts s to at most n bytes of valid UTF-8.
func truncate(s string, n int) string {
	if len(s) > n {
		s = s[:n]
	}
	return strings.ToValidUTF8(s, "")
}
