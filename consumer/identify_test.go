package consumer

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// A redriven record carries the id it was dead-lettered with; that id wins
// over every other source, so the copy is deduplicated against the first
// delivery even when the first id came from a Kafka position.
func TestRedriveEventIDWinsOverEverySource(t *testing.T) {
	cfg := Config{
		Name:     "c",
		Identify: IdentifyConfig{IDHeaders: []string{"id"}, EventID: func(*Message) (string, error) { return "from-func", nil }},
	}
	cfg, err := cfg.withDefaults()
	require.NoError(t, err)
	cfg.Identify.IDHeaders = []string{"id"}
	m := &Message{
		ID:         "from-property",
		FallbackID: "orders/1/7",
		Headers:    map[string]string{"id": "from-header", HeaderRedriveEventID: "orders/0/42"},
	}
	idt, kind, err := cfg.identify(m)
	require.NoError(t, err)
	require.Empty(t, kind)
	require.Equal(t, "orders/0/42", idt.id)

	delete(m.Headers, HeaderRedriveEventID)
	idt, _, err = cfg.identify(m)
	require.NoError(t, err)
	require.Equal(t, "from-func", idt.id, "without a redrive header the usual order applies")

	cfg.Identify.EventID = func(*Message) (string, error) { return "", errors.New("no id") }
	_, kind, err = cfg.identify(m)
	require.Error(t, err)
	require.Equal(t, KindMissingID, kind)
	m.Headers[HeaderRedriveEventID] = "orders/0/42"
	idt, _, err = cfg.identify(m)
	require.NoError(t, err, "the EventID function is not asked for a redriven record's id")
	require.Equal(t, "orders/0/42", idt.id)
}

// A redrive goes back to the topic, where other consumers read it too. The
// id it was dead-lettered under is its own consumer's; another consumer
// identifies the copy its own way, with the first delivery's position in
// place of the copy's, so a record it handled is its duplicate.
func TestRedriveOfAnotherConsumersDeadLetterIsIdentifiedAsItsFirstDelivery(t *testing.T) {
	var sawFallback string
	cfg, err := Config{Name: "shipping"}.withDefaults()
	require.NoError(t, err)
	copyOf := func(owner string) *Message {
		return &Message{
			FallbackID: "orders/0/90@t",
			Headers: map[string]string{
				"id":                    "order-7",
				HeaderRedriveEventID:    "billing-id-of-order-7",
				HeaderRedriveConsumer:   owner,
				HeaderRedriveFallbackID: "orders/0/3@t",
			},
		}
	}

	idt, _, err := cfg.identify(copyOf("billing"))
	require.NoError(t, err)
	require.Equal(t, "order-7", idt.id, "another consumer's redrive id is not this consumer's")
	require.False(t, idt.firstPosition)

	m := copyOf("billing")
	delete(m.Headers, "id")
	idt, _, err = cfg.identify(m)
	require.NoError(t, err)
	require.Equal(t, "orders/0/3@t", idt.id, "the first delivery's position, not the copy's")
	require.True(t, idt.firstPosition, "a source that deduplicates by position is asked about it")

	cfg.Identify.EventID = func(m *Message) (string, error) { sawFallback = m.FallbackID; return "", nil }
	idt, _, err = cfg.identify(m)
	require.NoError(t, err)
	require.Equal(t, "orders/0/3@t", sawFallback, "EventID sees the first delivery's position")
	require.Equal(t, "orders/0/3@t", idt.id)
	require.Equal(t, "orders/0/90@t", m.FallbackID, "the message itself is not modified")

	idt, _, err = cfg.identify(copyOf("shipping"))
	require.NoError(t, err)
	require.Equal(t, "billing-id-of-order-7", idt.id, "this consumer's own redrive keeps its id")
	require.False(t, idt.firstPosition)
	m = copyOf("shipping")
	m.Headers[HeaderRedriveEventID] = "orders/0/3@t"
	idt, _, err = cfg.identify(m)
	require.NoError(t, err)
	require.False(t, idt.firstPosition, "its own dead letter's first position is done: dead-lettered")
	m = copyOf("shipping")
	delete(m.Headers, "id")
	delete(m.Headers, HeaderRedriveEventID) // dead-lettered before it had an id
	idt, _, err = cfg.identify(m)
	require.NoError(t, err)
	require.Equal(t, "orders/0/3@t", idt.id)
	require.False(t, idt.firstPosition, "its own dead letter without an id: its first position is done too")
	cfg.Identify.EventID = nil
	idt, _, err = cfg.identify(&Message{FallbackID: "orders/0/3@t"})
	require.NoError(t, err)
	require.False(t, idt.firstPosition, "not a copy")
}

// A dead letter carries the message's fallback id, its first delivery's
// when the message is itself a redriven copy, for a redrive to carry back.
func TestDeadLetterCarriesTheFirstDeliverysFallbackID(t *testing.T) {
	dl := &DeadLetter{Kind: KindHandler, Consumer: "billing", EventID: "e"}
	m := &Message{FallbackID: "orders/1/5@t", Partition: 1, Offset: 5}
	require.Equal(t, "orders/1/5@t", dl.Headers(m)[HeaderFallbackID])
	m.Headers = map[string]string{HeaderRedriveFallbackID: "orders/0/3@t"}
	require.Equal(t, "orders/0/3@t", dl.Headers(m)[HeaderFallbackID])
	_, ok := dl.Headers(&Message{Partition: -1, Offset: -1})[HeaderFallbackID]
	require.False(t, ok, "no header when the adapter gives no fallback id")
}

// MaxIDLength bounds the ids events carry, not the adapter's fallback id:
// a Kafka position on a topic named with Kafka's 249 characters is longer
// than its 256-byte default, and such records were all dead-lettered as
// KindInvalidID, their redriven copies too.
func TestFallbackIDsAreNotBoundByMaxIDLength(t *testing.T) {
	cfg, err := Config{Name: "c"}.withDefaults()
	require.NoError(t, err)
	position := strings.Repeat("t", 249) + "/0/9223372036854775806@AAAAAAAAAAAAAAAAAAAAAA"
	m := &Message{FallbackID: position}
	idt, kind, err := cfg.identify(m)
	require.NoError(t, err)
	require.Empty(t, kind)
	require.Equal(t, position, idt.id)

	copied := &Message{FallbackID: "dlq/0/1", Headers: map[string]string{
		HeaderRedriveConsumer: "c", HeaderRedriveEventID: position, HeaderRedriveFallbackID: position}}
	idt, _, err = cfg.identify(copied)
	require.NoError(t, err, "a redriven copy of such a record")
	require.Equal(t, position, idt.id)

	m = &Message{ID: position, FallbackID: "orders/0/1"}
	_, kind, err = cfg.identify(m)
	require.Error(t, err, "an id the event carries is still bound")
	require.Equal(t, KindInvalidID, kind)
	m = &Message{FallbackID: strings.Repeat("t", maxIDLimit+1)}
	_, kind, err = cfg.identify(m)
	require.Error(t, err, "past what the dedup keys hold")
	require.Equal(t, KindInvalidID, kind)
}
