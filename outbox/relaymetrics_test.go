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

// A relay whose Run returned is not kept alive by the meter provider its
// gauges were registered with (the global one by default, which lives as
// long as the process): a service that stops and starts relays, on
// tables or databases it relays for a while, would otherwise keep every
// relay it ever made, with its publisher, and their gauges reported.
func TestStoppedRelayIsNotKeptByItsGauges(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	rd := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd))
	r, stop := startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MeterProvider: mp})
	require.Eventually(t, r.Leader, 10*time.Second, 5*time.Millisecond)
	assert.EqualValues(t, 1, metricValue(t, rd, outbox.LeaderMetric))
	stop()

	relay := weak.Make(r)
	r = nil
	runtime.GC()
	runtime.GC()
	assert.True(t, relay.Value() == nil, "the stopped relay is still reachable, from its gauges' callbacks")
	runtime.KeepAlive(mp)
}

// A batch that fails because the database went away under it (the
// leader's session ended while the broker worked on the batch, so its
// settlement could not be written) is counted in FailuresMetric, as the
// metric's documentation says of a database that is unavailable: an
// operator alerting on it would otherwise never hear of a database outage,
// which ends the session rather than failing a statement.
func TestBatchFailedForALostDatabaseSessionIsCounted(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	rd := sdkmetric.NewManualReader()
	pub := &gatedPublisher{Publisher: k.publisher(t), entered: make(chan struct{}, 1), release: make(chan struct{})}
	startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond,
		InfraBackoff:  outbox.Backoff{Initial: 10 * time.Millisecond, Max: 20 * time.Millisecond},
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd))})
	addCommitted(t, pool, d.msg("a", "a/1"))
	<-pub.entered
	var pid int32
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT pid FROM pg_locks
WHERE locktype = 'advisory' AND classid = $1::bigint::oid AND objid = 'outbox'::regclass AND objsubid = 2 AND granted`,
		int64(0x6f626f78)).Scan(&pid))
	var killed bool
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT pg_terminate_backend($1)`, pid).Scan(&killed))
	require.True(t, killed)
	close(pub.release)

	// The next session writes the settlement the lost one could not.
	waitRows(t, pool, "true", 0, 30*time.Second)
	assert.Equal(t, []string{"a/1"}, bodies(d.read(t, 1)))
	assert.EqualValues(t, 1, metricValue(t, rd, outbox.FailuresMetric), "the batch the lost session failed is counted")
}

// The metrics' and the span's once.outbox.table is the table's name as
// configured, for an alert or a dashboard to match: it was the quoted SQL
// name ("outbox" with its quotes, "billing"."outbox"), which a Prometheus
// matcher once_outbox_table="outbox" never matched.
func TestTableAttributeIsTheNameUnquoted(t *testing.T) {
	k := newKafka(t)
	pool, schema := migrated(t)
	rd := sdkmetric.NewManualReader()
	store, err := outbox.New(outbox.Config{Schema: schema})
	require.NoError(t, err)
	r, _ := startRelay(t, pool, k.publisher(t), outbox.RelayConfig{Store: store, PollInterval: 20 * time.Millisecond,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd))})
	require.Eventually(t, r.Leader, 10*time.Second, 5*time.Millisecond)
	var rm metricdata.ResourceMetrics
	require.NoError(t, rd.Collect(context.Background(), &rm))
	var tables []string
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == outbox.LeaderMetric {
				for _, p := range g.DataPoints {
					v, _ := p.Attributes.Value("once.outbox.table")
					tables = append(tables, v.AsString())
				}
			}
		}
	}
	assert.Equal(t, []string{schema + ".outbox"}, tables)
}
