package backoff

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestDelayDoublesWithinJitterAndCaps(t *testing.T) {
	p := Policy{Initial: 100 * time.Millisecond, Max: time.Second}
	for n, base := range map[int]time.Duration{1: 100, 2: 200, 3: 400, 4: 800, 5: 1000, 40: 1000} {
		base *= time.Millisecond
		for range 50 {
			d := p.Delay(n)
			require.GreaterOrEqual(t, d, base*8/10, "retry %d", n)
			require.LessOrEqual(t, d, base*12/10, "retry %d", n)
		}
	}
	require.Zero(t, Policy{}.Delay(3))
}

func TestSleepStopsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.False(t, Sleep(ctx, time.Hour))
	require.False(t, Sleep(ctx, 0))
	require.True(t, Sleep(context.Background(), 0))
}

func TestRetrierCountsAndResets(t *testing.T) {
	r := Retrier{Policy: Policy{Initial: time.Microsecond, Max: time.Millisecond}}
	require.True(t, r.Wait(context.Background()))
	require.True(t, r.Wait(context.Background()))
	require.Equal(t, 2, r.Failures())
	r.Reset()
	require.Zero(t, r.Failures())
}
