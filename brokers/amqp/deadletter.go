package amqp

import (
	"errors"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

// Headers marking a dead-letter copy shaped to what the broker accepts
// (see Delivery.DeadLetter).
const (
	// HeaderDiagnosticsCut names, comma-separated, the diagnostic headers
	// (consumer.DeadLetter.Headers) cut to fit the copy's properties into
	// one frame: an oversized event id or type, an error message or stack.
	// Each is cut to maxDiagnostic bytes, fewer only when the broker's
	// frame_max is very small.
	HeaderDiagnosticsCut = "once-diagnostics-cut"
	// HeaderOriginalDropped is set, to the size in bytes of the original
	// header table, on a copy written without the original headers: they
	// did not fit one frame beside the diagnostic headers, cut, or they
	// were, with those, more entries than amqp091 reads in one table
	// (8192). The copy keeps the body, the properties and the diagnostic
	// headers; the original message is acked once the copy is confirmed,
	// so those headers are gone. It has the name and meaning of the Kafka adapter's
	// header of the same name.
	HeaderOriginalDropped = "once-original-dropped"
	// HeaderValueDropped is set, to the body's size in bytes, on a copy
	// written without its body: the broker refused the body as larger
	// than its max_message_size, lowered since the message was published.
	// The original message is acked once the copy is confirmed, so the
	// body is lost. It has the name of the Kafka adapter's header for a
	// copy written without its value.
	HeaderValueDropped = "once-value-dropped"
)

// maxDiagnostic bounds each diagnostic header of a copy too large for a
// frame: the consumer cuts error messages and stacks to this already
// (consumer.DeadLetter.Headers); an invalid event id or an unknown type is
// not cut.
const maxDiagnostic = 4096

// maxHeaderEntries is the most entries amqp091 reads in one field table:
// a copy whose header table holds more (an original near that many beside
// the diagnostic headers) is taken by the broker, but closes the
// connection of every amqp091 client that reads it, once dlq's too.
const maxHeaderEntries = 8192

// frameOverhead is what a frame adds to its payload: type, channel and
// size before it, the end octet after.
const frameOverhead = 8

// deadLetterCopy is the dead-letter copy of a delivery, shaped to what the
// broker accepts.
type deadLetterCopy struct {
	d     *amqp091.Delivery
	diag  map[string]string // the consumer's diagnostic headers
	queue string
	// dropBody: the broker refused the body as larger than its
	// max_message_size; the copy goes without it.
	dropBody bool
	// What the last publishing left out: the diagnostic headers it cut,
	// the size of the original header table it dropped (0: kept), for the
	// frame size it was shaped to.
	cut             []string
	originalDropped int
	frameMax        int
}

// shaped reports whether the last publishing left something out.
func (c *deadLetterCopy) shaped() bool { return len(c.cut) > 0 || c.originalDropped > 0 }

// copyShape is what a dead-letter copy keeps of the original headers and
// how much of each diagnostic header (0: all of it).
type copyShape struct {
	original bool
	max      int
}

// copyShapes are tried in order until the copy's properties fit a frame
// and its headers a client's table: the copy as it is; its diagnostic
// headers cut; the original headers dropped; the diagnostic headers cut
// further (a frame_max near its 4096 byte minimum). The last is published
// whatever its size.
var copyShapes = []copyShape{{true, 0}, {true, maxDiagnostic}, {false, maxDiagnostic}, {false, 1024}, {false, 256}, {false, 64}}

// publishing returns the copy to publish on a connection whose frames
// carry at most frameMax bytes (0: no limit): the first of copyShapes
// whose content header fits one frame, with no more header entries than
// a client reads.
func (c *deadLetterCopy) publishing(frameMax int) amqp091.Publishing {
	d := c.d
	p := amqp091.Publishing{
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    amqp091.Persistent,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
	if c.dropBody {
		p.Body = nil
	}
	c.frameMax = frameMax
	for i, s := range copyShapes {
		diag, cut := cutDiagnostics(c.diag, s.max)
		if i > 0 && s.original && len(cut) == 0 {
			continue // the same copy as the first
		}
		p.Headers = c.headers(s.original, diag, cut)
		c.cut, c.originalDropped = cut, 0
		if !s.original && len(d.Headers) > 0 {
			c.originalDropped = tableSize(d.Headers)
			p.Headers[HeaderOriginalDropped] = strconv.Itoa(c.originalDropped)
		}
		if c.dropBody {
			p.Headers[HeaderValueDropped] = strconv.Itoa(len(d.Body))
		}
		if len(p.Headers) <= maxHeaderEntries && (frameMax <= 0 || headerFrameSize(&p) <= frameMax-frameOverhead) {
			break
		}
	}
	return p
}

// headers is the copy's header table: the original headers when original
// is set, overwritten by diag, the adapter's own headers and the list of
// the diagnostic headers cut.
func (c *deadLetterCopy) headers(original bool, diag map[string]string, cut []string) amqp091.Table {
	d := c.d
	h := make(amqp091.Table, len(d.Headers)+len(diag)+7)
	if original {
		for k, v := range d.Headers {
			if k == ccHeader {
				k = HeaderOriginalCC
			}
			h[k] = v
		}
	}
	for k, v := range diag {
		h[k] = v
	}
	h[HeaderOriginalExchange] = d.Exchange
	h[HeaderOriginalRoutingKey] = d.RoutingKey
	h[HeaderOriginalQueue] = c.queue
	if d.Expiration != "" {
		h[HeaderOriginalExpiration] = d.Expiration
	}
	if d.UserId != "" {
		h[HeaderOriginalUserID] = d.UserId
	}
	if len(cut) > 0 {
		h[HeaderDiagnosticsCut] = strings.Join(cut, ",")
	}
	return h
}

// tooLarge matches the reason RabbitMQ gives when it refuses a message
// whose body is larger than its max_message_size.
var tooLarge = regexp.MustCompile(`message size \d+ is larger than (?:configured )?max size (\d+)`)

// maxBodySize returns the max_message_size by which the broker refused a
// publish, or 0 when err is not that refusal. RabbitMQ measures the body
// alone against it.
func maxBodySize(err error) int {
	var ae *amqp091.Error
	if !errors.As(err, &ae) || ae.Code != amqp091.PreconditionFailed {
		return 0
	}
	m := tooLarge.FindStringSubmatch(ae.Reason)
	if m == nil {
		return 0
	}
	n, err := strconv.Atoi(m[1])
	if err != nil {
		return 0
	}
	return n
}

// cutDiagnostics returns diag with every value longer than max bytes cut
// to at most max bytes of valid UTF-8, and the sorted names of those cut;
// diag itself when max is 0 or nothing is longer.
func cutDiagnostics(diag map[string]string, max int) (map[string]string, []string) {
	if max <= 0 {
		return diag, nil
	}
	var cut []string
	for k, v := range diag {
		if len(v) > max {
			cut = append(cut, k)
		}
	}
	if len(cut) == 0 {
		return diag, nil
	}
	slices.Sort(cut)
	out := make(map[string]string, len(diag))
	for k, v := range diag {
		out[k] = cutText(v, max)
	}
	return out, cut
}

// cutText cuts s to at most n bytes of valid UTF-8.
func cutText(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return strings.ToValidUTF8(s[:n], "")
}

// headerFrameSize is the size of the payload of the content header frame
// that carries p's properties, as amqp091 writes it: class id, weight,
// body size, property flags, then each property set.
func headerFrameSize(p *amqp091.Publishing) int {
	n := 2 + 2 + 8 + 2
	for _, s := range [...]string{p.ContentType, p.ContentEncoding, p.CorrelationId, p.ReplyTo, p.Expiration, p.MessageId, p.Type, p.UserId, p.AppId} {
		if s != "" {
			n += 1 + len(s)
		}
	}
	if len(p.Headers) > 0 {
		n += tableSize(p.Headers)
	}
	if p.DeliveryMode > 0 {
		n++
	}
	if p.Priority > 0 {
		n++
	}
	if !p.Timestamp.IsZero() {
		n += 8
	}
	return n
}

// tableSize is the encoded size of a field table: its length, then each
// field's short-string name and typed value.
func tableSize(t amqp091.Table) int {
	n := 4
	for k, v := range t {
		n += 1 + len(k) + fieldSize(v)
	}
	return n
}

// fieldSize is the encoded size of a field value, type octet included, as
// amqp091 writes it. A type amqp091 cannot write counts as nothing: the
// publish fails on it before anything is sent.
func fieldSize(v any) int {
	switch x := v.(type) {
	case nil:
		return 1
	case bool, byte, int8:
		return 2
	case int16, uint16:
		return 3
	case int, int32, uint32, float32:
		return 5
	case int64, float64, time.Time:
		return 9
	case amqp091.Decimal:
		return 6
	case string:
		return 5 + len(x)
	case []byte:
		return 5 + len(x)
	case []any:
		n := 5
		for _, e := range x {
			n += fieldSize(e)
		}
		return n
	case amqp091.Table:
		return 1 + tableSize(x)
	default:
		return 0
	}
}
