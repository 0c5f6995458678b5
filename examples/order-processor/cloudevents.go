package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"

	"github.com/onceco/once/consumer"
)

// The service takes CloudEvents (https://cloudevents.io) in both content
// modes, as their Kafka and AMQP bindings define them, besides its own
// plain messages:
//
//   - binary mode: the payload is the message value, the attributes are
//     headers: ce_id and ce_type (Kafka), cloudEvents_id and
//     cloudEvents_type or cloudEvents:id and cloudEvents:type (AMQP
//     application properties), or the AMQP message-id and type properties;
//   - structured mode: the value is an application/cloudevents+json
//     document, {"specversion": "1.0", "id": ..., "type": ..., "data": {...}},
//     recognised by its specversion attribute (the consumer's envelope sees
//     the value only, not the content type).
//
// Either way the CloudEvent id is the event id, so a producer's re-send of
// an event (same id) is skipped as a duplicate, and its type picks the
// handler.

// IDHeaders and TypeHeaders are the headers the service reads an event's
// id and type from, in order: its own, then the CloudEvents bindings'.
var (
	IDHeaders   = []string{"id", "ce_id", "cloudEvents_id", "cloudEvents:id"}
	TypeHeaders = []string{"type", "ce_type", "cloudEvents_type", "cloudEvents:type"}
)

// CloudEventsContentType is the content type of a structured-mode
// CloudEvent in JSON.
const CloudEventsContentType = "application/cloudevents+json"

// structuredEvent is a structured-mode CloudEvent: the attributes the
// service reads, and the data.
type structuredEvent struct {
	SpecVersion string          `json:"specversion"`
	ID          string          `json:"id"`
	Type        string          `json:"type"`
	Data        json.RawMessage `json:"data"`
	DataBase64  string          `json:"data_base64"`
}

// parseStructured opens value as a structured-mode CloudEvent; ok is false
// for any other value (a plain payload, or bytes that are not JSON).
func parseStructured(value []byte) (ev structuredEvent, ok bool) {
	value = bytes.TrimSpace(value)
	if len(value) == 0 || value[0] != '{' || !bytes.Contains(value, []byte(`"specversion"`)) {
		return ev, false
	}
	if json.Unmarshal(value, &ev) != nil || ev.SpecVersion == "" {
		return structuredEvent{}, false
	}
	if ev.Data == nil && ev.DataBase64 != "" {
		if raw, err := base64.StdEncoding.DecodeString(ev.DataBase64); err == nil {
			ev.Data = raw
		}
	}
	return ev, true
}

// CloudEventsEnvelope is the consumer's envelope (consumer.Config.Envelope):
// it opens a structured-mode CloudEvent into its id, type and data, and
// passes every other message through whole, for the headers and the
// payload to speak for it.
type CloudEventsEnvelope struct{}

// Open implements consumer.Envelope.
func (CloudEventsEnvelope) Open(value []byte) (consumer.Opened, error) {
	ev, ok := parseStructured(value)
	if !ok {
		return consumer.Opened{Payload: value}, nil
	}
	return consumer.Opened{ID: ev.ID, Type: ev.Type, Payload: ev.Data}, nil
}

// Fingerprint is the consumer's fingerprint (consumer.Config.Identify.Fingerprint):
// the SHA-256 of the event's data, so that a CloudEvents re-send whose
// envelope changed (a new time attribute) is still a duplicate, while the
// same id with other data is an id conflict.
func Fingerprint(m *consumer.Message) []byte {
	data := m.Value
	if ev, ok := parseStructured(m.Value); ok {
		data = ev.Data
	}
	sum := sha256.Sum256(data)
	return sum[:]
}

// eventType is the message's type: the broker's type property, the type
// headers, or a structured CloudEvent's type attribute.
func eventType(m *consumer.Message, structured *structuredEvent) string {
	if m.Type != "" {
		return m.Type
	}
	for _, h := range TypeHeaders {
		if v := m.Headers[h]; v != "" {
			return v
		}
	}
	if structured != nil {
		return structured.Type
	}
	return ""
}
