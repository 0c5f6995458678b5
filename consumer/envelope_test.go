package consumer_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
)

// A structured CloudEvent whose data is binary carries it base64-encoded
// in data_base64 (CloudEvents JSON format, 3.1), not in data: the zero
// JSONEnvelope, documented to read CloudEvents' structured JSON, found no
// "data" and dead-lettered every such event as undecodable.
func TestJSONEnvelopeReadsACloudEventsBinaryData(t *testing.T) {
	o, err := consumer.JSONEnvelope{}.Open([]byte(`{"specversion":"1.0","id":"evt-1","type":"image.scanned","data_base64":"AAECaGk="}`))
	require.NoError(t, err)
	assert.Equal(t, "evt-1", o.ID)
	assert.Equal(t, "image.scanned", o.Type)
	assert.Equal(t, []byte{0, 1, 2, 'h', 'i'}, o.Payload)

	_, err = consumer.JSONEnvelope{}.Open([]byte(`{"specversion":"1.0","id":"evt-2","type":"t","data_base64":"not base64!"}`))
	assert.ErrorContains(t, err, "data_base64")

	// A named data field is the caller's format, not CloudEvents'.
	_, err = consumer.JSONEnvelope{DataField: "payload"}.Open([]byte(`{"id":"evt-3","payload_base64":"aGk="}`))
	assert.ErrorContains(t, err, `no "payload" field`)
}

// DataField is documented to default to "data": a JSONEnvelope with
// DataField "data" written out (or IDField and TypeField set, DataField
// spelt out beside them) is the default's format, and reads a CloudEvent's
// binary data from data_base64 as the zero value does. It dead-lettered
// every such event as undecodable.
func TestJSONEnvelopeWithTheDefaultDataFieldSpeltOutReadsBinaryData(t *testing.T) {
	event := []byte(`{"specversion":"1.0","id":"evt-1","type":"image.scanned","data_base64":"aGk="}`)
	o, err := consumer.JSONEnvelope{IDField: "id", TypeField: "type", DataField: "data"}.Open(event)
	require.NoError(t, err)
	assert.Equal(t, []byte("hi"), o.Payload)
	assert.Equal(t, "evt-1", o.ID)
}
