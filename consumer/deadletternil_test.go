package consumer_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
)

// A nil *DeadLetter describes no failure: its Headers are those of the
// zero DeadLetter (the message's position, no kind), and a nil *Message
// gives no headers of its own. Both panicked on the nil pointer, in a
// custom Source's DeadLetter or a tool that builds dead-letter headers.
func TestDeadLetterHeadersOfNil(t *testing.T) {
	m := &consumer.Message{Topic: "orders", Partition: 2, Offset: 7, FallbackID: "orders/2/7"}
	var dl *consumer.DeadLetter
	var h map[string]string
	require.NotPanics(t, func() { h = dl.Headers(m) })
	assert.Equal(t, (&consumer.DeadLetter{}).Headers(m), h, "a nil DeadLetter reads as the zero one")
	assert.Equal(t, "orders", h[consumer.HeaderOriginalTopic])
	assert.Equal(t, "orders/2/7", h[consumer.HeaderFallbackID])

	full := &consumer.DeadLetter{Kind: consumer.KindHandler, Error: "boom", EventID: "e1", Attempts: 3}
	require.NotPanics(t, func() { h = full.Headers(nil) })
	assert.Equal(t, string(consumer.KindHandler), h[consumer.HeaderErrorKind])
	assert.Equal(t, "e1", h[consumer.HeaderEventID])
	assert.NotContains(t, h, consumer.HeaderOriginalTopic, "no message, no position")
	assert.NotContains(t, h, consumer.HeaderOriginalPartition)
}

// memsource refuses a nil *DeadLetter with an error, as the Kafka source
// does, instead of panicking or writing a copy that says nothing of why.
func TestMemsourceRefusesANilDeadLetter(t *testing.T) {
	b := memsource.New(memsource.Options{})
	b.Publish(consumer.Message{Value: []byte(`{}`), Headers: map[string]string{"id": "a"}})
	d, err := b.Source().Receive(t.Context())
	require.NoError(t, err)
	require.NotPanics(t, func() { err = d.DeadLetter(t.Context(), nil) })
	require.Error(t, err)
	assert.Empty(t, b.DeadLetters())
}
