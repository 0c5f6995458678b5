package outbox_test

import (
	"context"
	"runtime"
	"testing"
	"time"
	"weak"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/onceco/once/outbox"
)

// nullPublisher confirms every record without sending it anywhere: what
// is published does not matter to the tests that use it.
type nullPublisher struct{}

func (nullPublisher) Publish(_ context.Context, recs []outbox.Record) []error {
	return make([]error, len(recs))
}

func (nullPublisher) Close() error { return nil }

// A relay made and never run (built to check a configuration, or one a
// supervisor never started) registers no gauge: it was kept for ever by
// the meter provider (the process's global one by default), with its
// pool and publisher, and reported once.outbox.leader 0 under the same
// table as the relay that runs, which the collection then read as 0 or
// as two relays, though one leads.
func TestRelayNeverRunIsNotKeptByItsGauges(t *testing.T) {
	pool, _ := migrated(t)
	rd := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd))
	cfg := outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MeterProvider: mp}
	r, _ := startRelay(t, pool, nullPublisher{}, cfg)
	require.Eventually(t, r.Leader, 10*time.Second, 5*time.Millisecond)

	relay := func() weak.Pointer[outbox.Relay] {
		idle, err := outbox.NewRelay(pool, nullPublisher{}, cfg)
		require.NoError(t, err)
		assert.Equal(t, []int64{1}, gaugeValues(t, rd, outbox.LeaderMetric), "the leader gauge of the table, with one relay running and leading")
		return weak.Make(idle)
	}()
	runtime.GC()
	runtime.GC()
	assert.True(t, relay.Value() == nil, "a relay never run is still reachable, from its gauges' callbacks")
	runtime.KeepAlive(mp)
}

// gaugeValues returns the values of the int64 gauge name's data points
// in one collection.
func gaugeValues(t testing.TB, rd *sdkmetric.ManualReader, name string) []int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, rd.Collect(context.Background(), &rm))
	var out []int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == name {
				for _, p := range g.DataPoints {
					out = append(out, p.Value)
				}
			}
		}
	}
	return out
}
