package consumer

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/onceco/once/internal/pgtext"
)

// Envelope opens a message whose value wraps the payload with its own id
// and type, such as a CloudEvent in structured JSON mode.
type Envelope interface {
	// Open returns the envelope's id and type (empty when absent) and the
	// payload bytes to decode. An error dead-letters the message with kind
	// KindDecode; one wrapped in RetryAfter is tried again later, as a
	// Decoder's is (see Config.Decoder).
	Open(value []byte) (Opened, error)
}

// Opened is what an Envelope found in a message.
type Opened struct {
	// ID and Type are the envelope's event id and type; empty when it has
	// none (the consumer then looks for them elsewhere).
	ID   string
	Type string
	// Payload is the event's data, which the Decoder decodes.
	Payload []byte
}

// JSONEnvelope opens a JSON object envelope. With the zero value it reads
// CloudEvents' structured JSON: {"id": ..., "type": ..., "data": {...}},
// the payload being the data's JSON, or the bytes of data_base64 for
// binary data. An envelope without its data field (a CloudEvent without
// data among them) fails to open: the message is dead-lettered with kind
// KindDecode.
type JSONEnvelope struct {
	// IDField names the id field. Defaults to "id".
	IDField string
	// TypeField names the type field. Defaults to "type".
	TypeField string
	// DataField names the payload field. Defaults to "data". Named
	// "data" (the default or spelt out), a missing data field is looked
	// for as CloudEvents' data_base64; any other name is read as it is.
	DataField string
}

// Open implements Envelope. The id may be a JSON string or number; a
// string that is not UTF-8 text (bytes that are not UTF-8, an escaped lone
// surrogate, which encoding/json would replace with U+FFFD, making it
// another event's id) fails to open.
func (e JSONEnvelope) Open(value []byte) (Opened, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(value, &fields); err != nil {
		return Opened{}, fmt.Errorf("envelope: %w", err)
	}
	var o Opened
	var err error
	rawID := fields[orDefault(e.IDField, "id")]
	if o.ID, err = scalar(rawID); err != nil {
		return Opened{}, fmt.Errorf("envelope id: %w", err)
	}
	if !decodesAsWritten(rawID) {
		// encoding/json put U+FFFD in place of what is not text: the
		// id would be another's, two events claimed under one.
		return Opened{}, errors.New("envelope id: not UTF-8 text (bytes that are not UTF-8, or an escaped lone surrogate)")
	}
	if o.Type, err = scalar(fields[orDefault(e.TypeField, "type")]); err != nil {
		return Opened{}, fmt.Errorf("envelope type: %w", err)
	}
	data, ok := fields[orDefault(e.DataField, "data")]
	if !ok && orDefault(e.DataField, "data") == "data" {
		// CloudEvents' JSON format carries binary data base64-encoded in
		// data_base64 instead.
		if b64, ok := fields["data_base64"]; ok {
			var s string
			if err := json.Unmarshal(b64, &s); err != nil {
				return Opened{}, fmt.Errorf("envelope data_base64: %w", err)
			}
			if o.Payload, err = base64.StdEncoding.DecodeString(s); err != nil {
				return Opened{}, fmt.Errorf("envelope data_base64: %w", err)
			}
			return o, nil
		}
	}
	if !ok {
		return Opened{}, fmt.Errorf("envelope: no %q field", orDefault(e.DataField, "data"))
	}
	o.Payload = data
	return o, nil
}

func scalar(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	if raw[0] == '"' {
		var s string
		err := json.Unmarshal(raw, &s)
		return s, err
	}
	var n json.Number
	if err := json.Unmarshal(raw, &n); err != nil {
		return "", errors.New("must be a string or a number")
	}
	return n.String(), nil
}

// decodesAsWritten reports whether raw, a JSON value that decoded, holds
// no bytes that are not UTF-8 and no escaped surrogate that is not half of
// a pair: what encoding/json replaces with U+FFFD without an error.
func decodesAsWritten(raw json.RawMessage) bool {
	if !utf8.Valid(raw) {
		return false
	}
	for i := 0; i < len(raw); i++ {
		if raw[i] != '\\' {
			continue
		}
		i++ // the escaped character; raw decoded, so \u has 4 hex digits
		if raw[i] != 'u' {
			continue
		}
		r := hex4(raw[i+1:])
		i += 4
		switch {
		case utf16.IsSurrogate(r) && r < 0xDC00 && i+6 < len(raw) && raw[i+1] == '\\' && raw[i+2] == 'u':
			// A high surrogate: a low one must follow.
			if low := hex4(raw[i+3:]); utf16.DecodeRune(r, low) == utf8.RuneError {
				return false
			}
			i += 6
		case utf16.IsSurrogate(r):
			return false
		}
	}
	return true
}

// hex4 is the rune of the 4 hex digits b starts with.
func hex4(b []byte) rune {
	n, _ := strconv.ParseUint(string(b[:4]), 16, 32)
	return rune(n)
}

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// identity is what the consumer derives from a message before handling it.
type identity struct {
	id, typ string
	payload []byte
	// firstPosition: id is the first delivery's fallback id of a redriven
	// copy of another consumer's dead letter (see FirstPositionChecker).
	firstPosition bool
}

// identify finds m's id, type and payload per the config's rules. A failure
// carries the dead-letter kind it calls for.
func (c *Config) identify(m *Message) (identity, ErrorKind, error) {
	copied := false
	if fb := fallbackID(m); fb != m.FallbackID {
		// A redriven copy: its position is not the record's, for EventID
		// as for the fallback below.
		first := *m
		first.FallbackID = fb
		m, copied = &first, true
	}
	idt := identity{id: m.ID, typ: m.Type, payload: m.Value}
	if c.Envelope != nil {
		o, err := c.Envelope.Open(m.Value)
		if err != nil {
			return c.unopened(m, idt), KindDecode, &DecodeError{Err: err}
		}
		idt.payload = o.Payload
		if idt.typ == "" {
			idt.typ = firstHeader(m.Headers, c.Identify.TypeHeaders)
		}
		if idt.typ == "" {
			idt.typ = o.Type
		}
		if idt.id == "" {
			idt.id = firstHeader(m.Headers, c.Identify.IDHeaders)
		}
		if idt.id == "" {
			idt.id = o.ID
		}
	} else {
		if idt.typ == "" {
			idt.typ = firstHeader(m.Headers, c.Identify.TypeHeaders)
		}
		if idt.id == "" {
			idt.id = firstHeader(m.Headers, c.Identify.IDHeaders)
		}
	}
	redriven := redriveEventID(m, c.Name)
	if c.Identify.EventID != nil && redriven == "" {
		id, err := c.Identify.EventID(m)
		if err != nil {
			// No id: the one the message carries (Message.ID, the
			// IDHeaders, the envelope's) is not the event's under
			// EventID, which replaces those rules. A dead letter named
			// by it would be redriven under it (HeaderRedriveEventID),
			// EventID never asked again.
			idt.id = ""
			return idt, KindMissingID, err
		}
		idt.id = id
	}
	if idt.id == "" {
		idt.id = m.FallbackID
		// Only another consumer's dead letter: this consumer's own first
		// position is done too (dead-lettered), and a dead letter that had
		// no id yet (an envelope that did not open) is redriven without
		// HeaderRedriveEventID.
		idt.firstPosition = copied && redriven == "" && !ownRedrive(m, c.Name)
	}
	if redriven != "" {
		idt.id = redriven
	}
	if idt.id == "" {
		return idt, KindMissingID, errors.New("the event carries no id and the source has no fallback id")
	}
	// MaxIDLength bounds the ids events carry. A fallback id is the
	// adapter's (a Kafka position holds a topic name of up to 249
	// characters), bounded only by what the dedup keys hold, whether it
	// came as the fallback, from EventID or as a redriven copy's id.
	maxLength := c.Identify.MaxIDLength
	if idt.id == m.FallbackID {
		maxLength = max(maxLength, maxIDLimit)
	}
	if err := validID(idt.id, maxLength); err != nil {
		return idt, KindInvalidID, err
	}
	return idt, "", nil
}

// unopened is idt, the identity of m, whose envelope did not open, as far
// as it is known without the envelope, for its dead letter: the id and type
// m carries outside it (Message.ID and Type, the IDHeaders and
// TypeHeaders), which come before the envelope's whatever it holds, and a
// redriven copy's id, which comes before every other. Not the fallback id,
// which comes after the envelope's unknown id: a replay would be claimed
// under it (HeaderRedriveEventID) instead of the id the envelope may hold.
// An EventID takes the place of every rule, and is not asked of a message
// it may not parse: then Message.ID alone.
func (c *Config) unopened(m *Message, idt identity) identity {
	if idt.typ == "" {
		idt.typ = firstHeader(m.Headers, c.Identify.TypeHeaders)
	}
	if idt.id == "" && c.Identify.EventID == nil {
		idt.id = firstHeader(m.Headers, c.Identify.IDHeaders)
	}
	if redriven := redriveEventID(m, c.Name); redriven != "" {
		idt.id = redriven
	}
	if validID(idt.id, c.Identify.MaxIDLength) != nil {
		// Not storable: the dead letter names no id rather than one
		// that is not an id.
		idt.id = ""
	}
	return idt
}

func firstHeader(h map[string]string, names []string) string {
	for _, n := range names {
		if v := h[n]; v != "" {
			return v
		}
	}
	return ""
}

// validID rejects ids PostgreSQL's text type cannot hold (invalid UTF-8,
// NUL) and ids longer than max bytes.
func validID(id string, max int) error {
	if len(id) > max {
		return fmt.Errorf("event id is %d bytes long, more than the %d allowed", len(id), max)
	}
	if !pgtext.Storable(id) {
		return errors.New("event id is not valid UTF-8 text")
	}
	return nil
}

func sha256Value(m *Message) []byte {
	sum := sha256.Sum256(m.Value)
	return sum[:]
}

func bytesReader(b []byte) io.Reader { return bytes.NewReader(b) }
