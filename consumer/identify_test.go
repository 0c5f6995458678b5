package consumer

import (
	"errors"
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
