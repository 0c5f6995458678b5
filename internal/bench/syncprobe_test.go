package bench

import (
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSyncProbeSamplesAndCleansUp(t *testing.T) {
	dir := t.TempDir()
	p := startSyncProbe(dir)
	require.NotNil(t, p)
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return len(p.samples) >= 3
	}, 10*time.Second, syncProbeEvery)
	samples := p.Stop()
	assert.GreaterOrEqual(t, len(samples), 3)
	assert.Equal(t, samples, p.Stop(), "a second Stop returns the same samples")
	left, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.Empty(t, left, "the probe's file is removed")
	for _, s := range samples {
		assert.Positive(t, s.took)
	}

	assert.Nil(t, startSyncProbe(""), "no directory, no probe")
	assert.Nil(t, (*probe)(nil).Stop())
}

func TestSyncStatsLeaveOutTheWarmUp(t *testing.T) {
	t0 := time.Now()
	samples := []probeSample{
		{at: t0, took: 500 * time.Millisecond}, // warm-up: left out
		{at: t0.Add(time.Second), took: 2 * time.Millisecond},
		{at: t0.Add(2 * time.Second), took: 40 * time.Millisecond},
		{at: t0.Add(3 * time.Second), took: time.Millisecond},
	}
	p99, longest := probeStats(samples, t0.Add(time.Second))
	assert.Equal(t, 40*time.Millisecond, p99)
	assert.Equal(t, 40*time.Millisecond, longest)
	p99, longest = probeStats(samples, t0.Add(time.Hour))
	assert.Zero(t, p99)
	assert.Zero(t, longest)
}

func TestLagProbeSamples(t *testing.T) {
	p := startLagProbe()
	samples := p.Stop()
	assert.NotEmpty(t, samples, "the probe records its first sleep before it looks at stop")
	assert.Equal(t, samples, p.Stop(), "a second Stop returns the same samples")
	for _, s := range samples {
		assert.Less(t, s.took, time.Second, "lateness is the sleep's overshoot, not its length or a clock reading")
	}
}
