package bench

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
)

// TestIdleSamplerCountsOnlyMomentsWithNothingHeld: before the first
// delivery nothing is sampled; while the row holds a delivery it is not
// idle; once all it received is acked, every sample is idle.
func TestIdleSamplerCountsOnlyMomentsWithNothingHeld(t *testing.T) {
	ctx := context.Background()
	b := memsource.New(memsource.Options{})
	b.Publish(consumer.Message{ID: "a", Value: []byte(`{}`)})
	b.Publish(consumer.Message{ID: "b", Value: []byte(`{}`)})
	m := newMeter(b.Source(), nil)

	before := startIdleSampler(m)
	assert.Never(t, func() bool { return before.taken() > 0 }, 5*idleSampleEvery, idleSampleEvery,
		"no sample before the first delivery")
	assert.Zero(t, before.Stop())

	first, err := m.Receive(ctx)
	require.NoError(t, err)
	second, err := m.Receive(ctx)
	require.NoError(t, err)
	require.NoError(t, first.Ack(ctx))
	busy := startIdleSampler(m) // one delivery held
	require.Eventually(t, func() bool { return busy.taken() >= 3 }, 10*time.Second, time.Millisecond)
	assert.Zero(t, busy.Stop(), "a row holding a delivery is not idle")

	require.NoError(t, second.Ack(ctx))
	idle := startIdleSampler(m) // everything received is acked
	require.Eventually(t, func() bool { return idle.taken() >= 3 }, 10*time.Second, time.Millisecond)
	assert.Equal(t, 1.0, idle.Stop(), "every sample with nothing held is idle")

	path := filepath.Join(t.TempDir(), "row.held.csv")
	busy.writeTimeline(path, m.firstAt())
	csv, err := os.ReadFile(path)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(csv)), "\n")
	require.Greater(t, len(lines), 3)
	assert.Equal(t, "at_ms,held", lines[0])
	for _, l := range lines[1:] {
		assert.True(t, strings.HasSuffix(l, ",1"), "the busy sampler saw one delivery held: %q", l)
	}
}
