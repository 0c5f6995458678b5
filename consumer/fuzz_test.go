package consumer

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"strings"
	"testing"
	"unicode/utf8"
)

func fuzzConfig(t testing.TB, envelope bool) Config {
	cfg, err := Config{Name: "fuzz"}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	if envelope {
		cfg.Envelope = JSONEnvelope{}
	}
	return cfg
}

// FuzzIdentify: no input makes id derivation panic, and every id it
// accepts can be stored (valid UTF-8, no NUL, within MaxIDLength).
func FuzzIdentify(f *testing.F) {
	f.Add("", "", "", "", []byte(`{"id":"a","type":"t","data":{}}`), true)
	f.Add("native", "t", "h-id", "topic/0/1", []byte(`{}`), false)
	f.Add("", "", "\x00", "", []byte(`{"id":12345678901234567890,"data":1}`), true)
	f.Add("", "", "\xff\xfe", "fallback", []byte(`not json`), true)
	f.Add("", "", strings.Repeat("x", 300), "", []byte(`{"id":null,"type":["x"],"data":null}`), true)
	f.Fuzz(func(t *testing.T, id, typ, headerID, fallback string, value []byte, envelope bool) {
		cfg := fuzzConfig(t, envelope)
		m := &Message{ID: id, Type: typ, FallbackID: fallback, Value: value,
			Headers: map[string]string{"ce_id": headerID, "traceparent": headerID}, Partition: -1, Offset: -1}
		idt, kind, err := cfg.identify(m)
		if err != nil {
			if kind == "" {
				t.Fatalf("error without a dead-letter kind: %v", err)
			}
			return
		}
		if idt.id == "" || len(idt.id) > cfg.Identify.MaxIDLength || !utf8.ValidString(idt.id) || strings.ContainsRune(idt.id, 0) {
			t.Fatalf("accepted an id that cannot be stored: %q", idt.id)
		}
		dl := &DeadLetter{Kind: KindDecode, Error: string(value), EventID: idt.id}
		for k, v := range dl.Headers(m) {
			if !utf8.ValidString(v) && k == HeaderErrorMessage {
				t.Fatalf("header %s is not valid UTF-8", k)
			}
		}
	})
}

type fuzzPayload struct {
	Order  string   `json:"order"`
	Amount int64    `json:"amount"`
	Tags   []string `json:"tags"`
}

// FuzzDecode: decoding any bytes, plain or in an envelope, with JSON or
// StrictJSON, returns a value or a DecodeError, never a panic.
func FuzzDecode(f *testing.F) {
	f.Add([]byte(`{"order":"o1","amount":5}`), false)
	f.Add([]byte(`{"id":"1","type":"order.paid","data":{"order":"o1","amount":1e400}}`), true)
	f.Add([]byte(`{"order":"o1","amount":5} trailing`), false)
	f.Add([]byte("\x00\x01\x02"), true)
	f.Fuzz(func(t *testing.T, value []byte, envelope bool) {
		for _, dec := range []Decoder{JSON, StrictJSON} {
			cfg := fuzzConfig(t, envelope)
			m := &Message{Value: value, FallbackID: "t/0/0", Partition: 0, Offset: 0}
			idt, _, err := cfg.identify(m)
			if err != nil {
				continue
			}
			_, kind, err := bind(func(ctx context.Context, tx pgx.Tx, ev Event[fuzzPayload]) error { return nil }, m, idt, dec)
			if err != nil && kind != KindDecode {
				t.Fatalf("decode failure with kind %q", kind)
			}
		}
	})
}

// TestStrictJSONRejectsTrailingData: anything but white space after the
// value is trailing data, a closing bracket or brace included (json's
// Decoder.More reports false for those, which once let `{...}}` through as
// a valid payload).
func TestStrictJSONRejectsTrailingData(t *testing.T) {
	for _, value := range []string{`{"order":"o1"}}`, `{"order":"o1"}]`, `{"order":"o1"} {}`, `{"order":"o1"} x`, `[1]]`} {
		var v any
		assert.Error(t, StrictJSON([]byte(value), &v), value)
	}
	for _, value := range []string{`{"order":"o1"}`, " {\"order\":\"o1\"} \n\t", `[1]`, `null`} {
		var v any
		assert.NoError(t, StrictJSON([]byte(value), &v), value)
	}
}
