package kafka

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// DeadLetter.Topic is the user's function: Open checked its answers, but
// each dead-letter copy called it again. One whose answer changed (a name
// with a date, a counter) sent copies to a topic Open never checked (one
// not there, or a consumed topic: dead letters consumed again), and one
// that panicked later crashed the process at a poison record. The names
// are taken once, at Open, and a panic there is an error naming the field.
func TestDeadLetterTopicNamesAreTakenOnceAtOpen(t *testing.T) {
	calls := 0
	cfg := Config{Brokers: []string{"b:9092"}, Group: "g", Topics: []string{"orders", "payments"}}.withDefaults()
	cfg.DeadLetter.Topic = func(topic string) string {
		calls++
		if calls > 2 {
			panic("asked again")
		}
		return topic + ".dead"
	}
	require.NoError(t, cfg.validate())
	assert.Equal(t, "orders.dead", cfg.DeadLetter.Topic("orders"))
	assert.Equal(t, "payments.dead", cfg.DeadLetter.Topic("payments"))
	assert.Equal(t, 2, calls, "once per topic")

	cfg = Config{Brokers: []string{"b:9092"}, Group: "g", Topics: []string{"orders"}}.withDefaults()
	cfg.DeadLetter.Topic = func(string) string { panic("no name") }
	err := cfg.validate()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "Config.DeadLetter.Topic")
	assert.Contains(t, err.Error(), "no name")
}
