package dlq

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
)

// Header is one record header. Kafka headers keep their order and may
// repeat; RabbitMQ headers are sorted by name.
type Header struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

// MarshalJSON writes the header as {"key": ..., "value": ...} and, for a
// key or value that is not UTF-8 (a Kafka header is bytes), its bytes in
// hex as key_hex or value_hex: JSON text cannot hold them, and
// encoding/json writes U+FFFD for each byte that is not UTF-8.
func (h Header) MarshalJSON() ([]byte, error) {
	type plain Header // without this method
	out := struct {
		plain
		KeyHex   string `json:"key_hex,omitempty"`
		ValueHex string `json:"value_hex,omitempty"`
	}{plain: plain(h)}
	if !utf8.ValidString(h.Key) {
		out.KeyHex = hex.EncodeToString([]byte(h.Key))
	}
	if !utf8.ValidString(h.Value) {
		out.ValueHex = hex.EncodeToString([]byte(h.Value))
	}
	return json.Marshal(out)
}

// Properties are the AMQP properties of a RabbitMQ dead letter; nil for
// Kafka records.
type Properties struct {
	MessageID       string    `json:"message_id,omitempty"`
	Type            string    `json:"type,omitempty"`
	ContentType     string    `json:"content_type,omitempty"`
	ContentEncoding string    `json:"content_encoding,omitempty"`
	CorrelationID   string    `json:"correlation_id,omitempty"`
	ReplyTo         string    `json:"reply_to,omitempty"`
	AppID           string    `json:"app_id,omitempty"`
	Priority        uint8     `json:"priority,omitempty"`
	Timestamp       time.Time `json:"timestamp,omitzero"`
}

// Record is one dead letter as read from a dead-letter topic or queue.
type Record struct {
	// Ref identifies the record within its Queue: "partition:offset" on
	// Kafka, a digest of the message on RabbitMQ (which has no position
	// that outlives a read). Filter.Refs selects records by it.
	Ref string `json:"ref"`
	// Queue is the dead-letter topic or queue the record was read from.
	Queue string `json:"queue"`
	// Position is the record's 1-based place in the read (partition by
	// partition on Kafka, queue order on RabbitMQ).
	Position int `json:"position"`
	// Partition and Offset locate a Kafka record in the dead-letter topic;
	// -1 on RabbitMQ.
	Partition int32 `json:"partition"`
	Offset    int64 `json:"offset"`
	// Key is the Kafka record key (nil when null); nil on RabbitMQ.
	Key []byte `json:"key,omitempty"`
	// Value is the original bytes (the Kafka value, the AMQP body).
	Value []byte `json:"value"`
	// Headers are the record's headers as text.
	Headers []Header `json:"headers"`
	// Properties are the AMQP properties; nil on Kafka.
	Properties *Properties `json:"properties,omitempty"`
	// Timestamp is when the broker (Kafka) or the dead-lettering consumer
	// (the failed-at header) wrote the copy.
	Timestamp time.Time `json:"timestamp,omitzero"`

	// raw is what a redrive republishes with its original types: the
	// sarama headers or the AMQP delivery.
	raw any
}

// Summary returns a copy of r without its payload, its key and what a
// redrive republishes (on Kafka, slices of the fetched batch; on RabbitMQ,
// the delivery and its body): what a listing keeps of each row, which
// shows none of them. Replay reads the records it replays anew.
func (r *Record) Summary() *Record {
	c := *r
	c.Key, c.Value, c.raw = nil, nil, nil
	return &c
}

// Header returns the value of the last header named key, or "".
func (r *Record) Header(key string) string {
	v, _ := r.lookup(key)
	return v
}

func (r *Record) lookup(key string) (string, bool) {
	for i := len(r.Headers) - 1; i >= 0; i-- {
		if r.Headers[i].Key == key {
			return r.Headers[i].Value, true
		}
	}
	return "", false
}

// Consumer is the name of the consumer that dead-lettered the record.
func (r *Record) Consumer() string { return r.Header(consumer.HeaderConsumer) }

// Kind is the dead-letter kind (decode, handler, panic, ...).
func (r *Record) Kind() string { return r.Header(consumer.HeaderErrorKind) }

// EventID is the event id the record was dead-lettered under; "" when the
// consumer could not identify it.
func (r *Record) EventID() string { return r.Header(consumer.HeaderEventID) }

// EventType is the event type the consumer read, if any.
func (r *Record) EventType() string { return r.Header(consumer.HeaderEventType) }

// Error is the error that dead-lettered the record.
func (r *Record) Error() string { return r.Header(consumer.HeaderErrorMessage) }

// FailedAt is when the record was dead-lettered; zero when the header is
// missing or malformed.
func (r *Record) FailedAt() time.Time {
	t, err := time.Parse(time.RFC3339Nano, r.Header(consumer.HeaderFailedAt))
	if err != nil {
		return time.Time{}
	}
	return t
}

// RedriveCount is how many times the record was redriven before it was
// dead-lettered (0 for a first failure).
func (r *Record) RedriveCount() int {
	n, err := strconv.Atoi(r.Header(consumer.HeaderRedriveCount))
	if err != nil || n < 0 {
		return 0
	}
	return n
}

// Destination names where a redrive publishes the record: "topic" on
// Kafka, "exchange/routing-key" on RabbitMQ ("(default)" for the default
// exchange); "" when unknown.
func (r *Record) Destination() string {
	if r.Properties == nil {
		return r.Header(consumer.HeaderOriginalTopic)
	}
	ex, ok := r.lookup(amqp.HeaderOriginalExchange)
	if !ok {
		return ""
	}
	if ex == "" {
		ex = "(default)"
	}
	return ex + "/" + r.Header(amqp.HeaderOriginalRoutingKey)
}

// Printable reports whether the value is valid UTF-8 text without control
// characters other than tab and line breaks, so that it can be shown as
// text rather than as a hex dump. The controls are those of C0 (ESC among
// them), DEL, and those of C1 (U+0080 to U+009F), whose U+009B a terminal
// may take for ESC [; and Unicode's bidirectional controls (embeddings,
// overrides, isolates and marks), which show the text around them
// reordered: an event id that reads as another.
func Printable(b []byte) bool {
	if !utf8.Valid(b) {
		return false
	}
	for _, c := range string(b) {
		if unicode.IsControl(c) && c != '\t' && c != '\n' && c != '\r' || c == utf8.RuneError || unicode.Is(unicode.Bidi_Control, c) {
			return false
		}
	}
	return true
}

// ErrNotReplayable is wrapped by Replayable's errors.
var ErrNotReplayable = errors.New("not replayable")

// kindsThatFailAgain are dead-letter kinds whose redrive is dead-lettered
// again whatever was fixed meanwhile: the id is the problem, not the code.
var kindsThatFailAgain = []string{
	string(consumer.KindIDConflict),
	string(consumer.KindInvalidID),
	string(consumer.KindMissingID),
}

// Replayable returns nil when a redrive of r can be deduplicated and knows
// where to go, or an error wrapping ErrNotReplayable that says why not. A
// record dead-lettered before it had an id (an envelope that did not open)
// is replayable when the copy can be identified as its first delivery would
// have been: on RabbitMQ always (ids come from the message, never its
// position), on Kafka when it carries its first position
// (once-fallback-id).
// With force, records of kinds that would only be dead-lettered again
// (id-conflict, invalid-id, missing-id) are replayable too, and so are
// RabbitMQ copies written without their original headers
// (amqp.HeaderOriginalDropped), which the exchange's other consumers may
// not recognise as the message they handled.
func (r *Record) Replayable(force bool) error {
	switch {
	case r.EventID() == "" && r.Properties == nil && r.Header(consumer.HeaderFallbackID) == "":
		// A Kafka copy's own position would be its id.
		return fmt.Errorf("%w: no event id and no first position (kind %s): a redrive could not be deduplicated", ErrNotReplayable, r.Kind())
	case r.Destination() == "":
		return fmt.Errorf("%w: no original destination header", ErrNotReplayable)
	case r.Properties != nil && r.Header(amqp.HeaderValueDropped) != "":
		return fmt.Errorf("%w: the copy was written without its body (%s bytes, over the broker's max_message_size); the body was not kept",
			ErrNotReplayable, r.Header(amqp.HeaderValueDropped))
	case r.identityCut() != "":
		return fmt.Errorf("%w: the copy's %s header was cut to fit the broker's frame: a redrive could not be deduplicated",
			ErrNotReplayable, r.identityCut())
	case !force && r.Properties != nil && r.Header(amqp.HeaderOriginalDropped) != "":
		// The original headers may hold what the exchange's other
		// consumers identify the message by (an id header): they would
		// take the redrive for a new event.
		return fmt.Errorf("%w: the copy was written without its original headers (%s bytes: too large for a frame, or too many headers, beside the diagnostics): "+
			"other consumers of the exchange could not deduplicate a redrive (force to replay anyway)",
			ErrNotReplayable, r.Header(amqp.HeaderOriginalDropped))
	case r.Header(kafka.HeaderValueDropped) != "":
		return fmt.Errorf("%w: the copy was written without its value (%s bytes); the original is at %s/%s/%s",
			ErrNotReplayable, r.Header(kafka.HeaderValueDropped), r.Header(consumer.HeaderOriginalTopic),
			r.Header(consumer.HeaderOriginalPartition), r.Header(consumer.HeaderOriginalOffset))
	case !force && slices.Contains(kindsThatFailAgain, r.Kind()):
		return fmt.Errorf("%w: kind %s is dead-lettered again on every redrive (force to replay anyway)", ErrNotReplayable, r.Kind())
	}
	return nil
}

// identityCut returns the first of the headers a redrive identifies the
// record by (its event id, fallback id and consumer) that the dead-letter
// copy had to cut to fit the broker's frame (amqp.HeaderDiagnosticsCut),
// or "".
func (r *Record) identityCut() string {
	cut := strings.Split(r.Header(amqp.HeaderDiagnosticsCut), ",")
	for _, h := range []string{consumer.HeaderEventID, consumer.HeaderFallbackID, consumer.HeaderConsumer} {
		if slices.Contains(cut, h) {
			return h
		}
	}
	return ""
}

// diagnosticHeaders are the headers the dead-lettering wrote over the
// original ones. A redrive removes them, so the redriven record is the
// original plus the redrive headers.
var diagnosticHeaders = map[string]bool{
	consumer.HeaderOriginalTopic:       true,
	consumer.HeaderOriginalPartition:   true,
	consumer.HeaderOriginalOffset:      true,
	consumer.HeaderOriginalTimestamp:   true,
	consumer.HeaderConsumer:            true,
	consumer.HeaderEventID:             true,
	consumer.HeaderEventType:           true,
	consumer.HeaderAttempts:            true,
	consumer.HeaderErrorKind:           true,
	consumer.HeaderErrorMessage:        true,
	consumer.HeaderErrorStack:          true,
	consumer.HeaderErrorSQLState:       true,
	consumer.HeaderFailedAt:            true,
	consumer.HeaderFingerprint:         true,
	consumer.HeaderOriginalFingerprint: true,
	consumer.HeaderOriginalProcessedAt: true,
	consumer.HeaderFallbackID:          true,
	kafka.HeaderValueDropped:           true,
	kafka.HeaderOriginalDropped:        true,
	amqp.HeaderOriginalExchange:        true,
	amqp.HeaderOriginalRoutingKey:      true,
	amqp.HeaderOriginalQueue:           true,
	amqp.HeaderOriginalExpiration:      true,
	amqp.HeaderOriginalUserID:          true,
	amqp.HeaderDiagnosticsCut:          true,
	amqp.HeaderOriginalCC:              true,
	consumer.HeaderRedriveEventID:      true,
	consumer.HeaderRedriveConsumer:     true,
	consumer.HeaderRedriveFallbackID:   true,
	consumer.HeaderRedriveCount:        true,
	consumer.HeaderRedrivenAt:          true,
	consumer.HeaderRedrivenBy:          true,
}

// redriveHeaders are the headers a redrive of r adds, in this order.
func redriveHeaders(r *Record, at time.Time, by string) []Header {
	var h []Header
	if id := r.EventID(); id != "" {
		h = append(h, Header{consumer.HeaderRedriveEventID, id})
	}
	// The record goes back where other consumers read it too: the id it was
	// dead-lettered under is its consumer's, and its first position is
	// every consumer's.
	if c := r.Consumer(); c != "" {
		h = append(h, Header{consumer.HeaderRedriveConsumer, c})
	}
	if fb := r.Header(consumer.HeaderFallbackID); fb != "" {
		h = append(h, Header{consumer.HeaderRedriveFallbackID, fb})
	}
	h = append(h,
		Header{consumer.HeaderRedriveCount, strconv.Itoa(r.RedriveCount() + 1)},
		Header{consumer.HeaderRedrivenAt, at.UTC().Format(time.RFC3339Nano)},
	)
	if by != "" {
		h = append(h, Header{consumer.HeaderRedrivenBy, by})
	}
	return h
}

// acquiredCountHeader is the header in which a quorum queue of RabbitMQ
// 4.3 or later counts the times it gave a message to a consumer, a read
// that put it back included.
const acquiredCountHeader = "x-acquired-count"

// brokerCount reports whether key is a header in which the broker counts a
// message's deliveries (x-delivery-count, x-acquired-count): a quorum queue
// sets it anew at every read of the dead letters.
func brokerCount(key string) bool {
	return key == amqp.DeliveryCountHeader || key == acquiredCountHeader
}

// amqpRef is the Ref of a RabbitMQ dead letter: a digest of what tells two
// dead letters apart (each dead-lettering has its own failed-at time),
// without the counts a quorum queue changes on every read.
func amqpRef(body []byte, headers []Header) string {
	h := sha256.New()
	for _, hd := range headers {
		if brokerCount(hd.Key) {
			continue
		}
		h.Write([]byte(hd.Key))
		h.Write([]byte{0})
		h.Write([]byte(hd.Value))
		h.Write([]byte{0})
	}
	h.Write(body)
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// kafkaRef is the Ref of a Kafka dead letter.
func kafkaRef(partition int32, offset int64) string {
	return strconv.FormatInt(int64(partition), 10) + ":" + strconv.FormatInt(offset, 10)
}

// Filter selects records. Zero fields select everything.
type Filter struct {
	// Consumer is the consumer name (once-consumer), exactly.
	Consumer string
	// Kinds are dead-letter kinds; a record of any of them matches.
	Kinds []string
	// EventID is an event id, exactly, or a prefix followed by "*"
	// ("*" alone selects every record: Check refuses it). An id that
	// itself ends in "*" is given with a backslash before that star
	// (`sku\*` is the id "sku*" alone); backslashes right before the
	// final star come in pairs for one of the id's own (`a\\*` is the
	// prefix `a\`). A backslash elsewhere is the id's.
	EventID string
	// Since and Until bound the dead-lettering time (once-failed-at),
	// Since inclusive, Until exclusive. A record without that header
	// matches no time bound.
	Since, Until time.Time
	// Refs are record refs; a record whose Ref is among them matches.
	Refs []string
	// Search is text looked for, case-insensitively, in the event id and
	// type, the error, the consumer and the kind. Not in the ref (Refs
	// selects by it): a search for an order number would select every
	// record whose Kafka offset or RabbitMQ digest holds its digits.
	Search string
}

// Check returns an error naming a field of f that is set yet cannot
// narrow the selection: an EventID of "*" alone (the empty prefix, which
// every id has, and a record without one too) or a Search of blanks alone
// (which nearly every error holds). Such a field most often comes of a
// script's empty variable ("${ORDER}*"); taken for a filter, it would have
// a replay redrive the whole destination as if -all had been given.
func (f *Filter) Check() error {
	if f.EventID == "*" {
		return fmt.Errorf("id %q: give a prefix before the * (a * alone selects every record, with an id or without)", f.EventID)
	}
	if f.Search != "" && strings.TrimSpace(f.Search) == "" {
		return fmt.Errorf("search %q: give text to look for (blanks alone are in nearly every record)", f.Search)
	}
	return nil
}

// Match reports whether r is selected by f.
func (f *Filter) Match(r *Record) bool {
	if f.Consumer != "" && r.Consumer() != f.Consumer {
		return false
	}
	if len(f.Kinds) > 0 && !slices.Contains(f.Kinds, r.Kind()) {
		return false
	}
	if !matchID(f.EventID, r.EventID()) {
		return false
	}
	if !f.Since.IsZero() || !f.Until.IsZero() {
		at := r.FailedAt()
		if at.IsZero() || (!f.Since.IsZero() && at.Before(f.Since)) || (!f.Until.IsZero() && !at.Before(f.Until)) {
			return false
		}
	}
	if len(f.Refs) > 0 && !slices.Contains(f.Refs, r.Ref) {
		return false
	}
	if f.Search != "" {
		q := strings.ToLower(f.Search)
		found := false
		for _, s := range []string{r.EventID(), r.EventType(), r.Error(), r.Consumer(), r.Kind()} {
			if strings.Contains(strings.ToLower(s), q) {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

func matchID(pattern, id string) bool {
	if pattern == "" {
		return true
	}
	text, prefix := idPattern(pattern)
	if prefix {
		return strings.HasPrefix(id, text)
	}
	return id == text
}

// idPattern reads Filter.EventID: the id, or the prefix when it ends in
// an unescaped "*". An odd run of backslashes before the final star
// escapes it, so that an id ending in a star can be selected alone; each
// pair in the run is one backslash of the id.
func idPattern(pattern string) (text string, prefix bool) {
	body, star := strings.CutSuffix(pattern, "*")
	if !star {
		return pattern, false
	}
	n := len(body) - len(strings.TrimRight(body, `\`))
	text = body[:len(body)-n] + strings.Repeat(`\`, n/2)
	if n%2 == 1 {
		return text + "*", false
	}
	return text, true
}
