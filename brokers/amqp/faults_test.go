package amqp_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// running is a consumer running in the background.
type running struct {
	c    *consumer.Consumer[payload]
	stop func() error
}

func startConsumer(t testing.TB, pool *pgxpool.Pool, src consumer.Source, cfg consumer.Config, h consumer.Handler[payload]) *running {
	t.Helper()
	if cfg.Telemetry.Logger == nil {
		cfg.Telemetry.Logger = testLogger(t)
	}
	c, err := consumer.New(pool, src, h, cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	var runErr error
	stop := func() error {
		once.Do(func() { cancel(); runErr = <-done })
		return runErr
	}
	t.Cleanup(func() { _ = stop() })
	return &running{c: c, stop: stop}
}

// effectsDB returns a pool on a fresh schema with the effects table.
func effectsDB(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(context.Background(), effectsDDL)
	require.NoError(t, err)
	return pool
}

// waitAllEffects waits until every one of n events has an effect and the
// queue has nothing ready.
func waitAllEffects(t testing.TB, pool *pgxpool.Pool, a *admin, q string, n int, within time.Duration) {
	t.Helper()
	require.Eventually(t, func() bool {
		_, d, err := effectCounts(context.Background(), pool)
		if err != nil || d < n {
			return false
		}
		ready, err := a.ready(q)
		return err == nil && ready == 0
	}, within, 20*time.Millisecond, "want effects of %d events and an empty queue", n)
}

// requireLeftoversProcessed takes what is left in q after the consumer
// stopped (deliveries in flight at the stop go back to the queue) and
// checks that each is a copy of an event whose effect exists, i.e. nothing
// unprocessed was left behind.
func requireLeftoversProcessed(t testing.TB, a *admin, q string, ids []string) {
	t.Helper()
	left, err := a.getAll(q)
	require.NoError(t, err)
	known := map[string]bool{}
	for _, id := range ids {
		known[id] = true
	}
	for _, d := range left {
		assert.True(t, known[d.MessageId], "left in the queue unprocessed: %q", d.MessageId)
	}
	if len(left) > 0 {
		t.Logf("%d already-processed copies were in flight at the stop and went back to the queue", len(left))
	}
}

// TestConnectionCutsMidStream cuts the TCP connection between the source
// and the broker several times during a 10k-message run: nothing is lost,
// no event has two effects, and the source reconnects by itself each time.
func TestConnectionCutsMidStream(t *testing.T) {
	t.Parallel()
	const n = 10000
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	ids := eventIDs("cut", n)
	require.NoError(t, a.publish("", q, messagesFor(ids)...))
	pool := effectsDB(t)

	p, proxied := startProxy(t, brokerURL(t))
	rd := sdkmetric.NewManualReader()
	src := openSource(t, amqp.Config{URL: proxied, Queue: q, Prefetch: 128,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd))})
	r := startConsumer(t, pool, src, consumer.Config{Name: "cut-test", Concurrency: 8}, recordEffect)

	cuts := []uint64{1000, 3000, 5500, 8000}
	for i, at := range cuts {
		require.Eventually(t, func() bool { return r.c.Stats().Handled >= at }, 120*time.Second, 5*time.Millisecond,
			"want %d events handled before cut %d", at, i+1)
		require.Equal(t, 1, p.Cut(), "one connection goes through the proxy")
		require.Eventually(t, func() bool { return counterValue(t, rd, amqp.ReconnectsMetric) == int64(i+1) },
			30*time.Second, 5*time.Millisecond, "the source must reconnect by itself after cut %d", i+1)
	}
	waitAllEffects(t, pool, a, q, n, 120*time.Second)
	require.NoError(t, r.stop())

	requireExactlyOnce(t, pool, ids)
	st := r.c.Stats()
	assert.Zero(t, st.DeadLettered, "a lost connection is not poison")
	assert.LessOrEqual(t, st.Handled, uint64(n), "a commit whose delivery died meanwhile counts as a duplicate later")
	assert.Equal(t, int64(len(cuts)), counterValue(t, rd, amqp.ReconnectsMetric))
	t.Logf("%d cuts: received %d, handled %d, duplicates %d (committed before a cut, acked too late)", len(cuts), st.Received, st.Handled, st.Duplicates)
	requireLeftoversProcessed(t, a, q, ids)
}

// TestBrokerRestartMidStream stops and restarts the RabbitMQ application
// during a 10k-message run on a quorum queue, on a node of its own.
func TestBrokerRestartMidStream(t *testing.T) {
	t.Parallel()
	node := privateNode(t)
	const n = 10000
	a := newAdminAt(t, node.url)
	q := queueName(t)
	a.declare(q, amqp.QueueQuorum)
	ids := eventIDs("restart", n)
	require.NoError(t, a.publish("", q, messagesFor(ids)...))
	pool := effectsDB(t)

	rd := sdkmetric.NewManualReader()
	src := openSource(t, amqp.Config{URL: node.url, Queue: q, QueueType: amqp.QueueQuorum, Prefetch: 128,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd))})
	// From the 3000th call on, handlers wait at a gate until the broker
	// has stopped: the restart comes mid-stream whatever the machine's
	// speed, with transactions in flight whose channel dies under them.
	const gateAt = 3000
	var calls atomic.Int64
	gate := make(chan struct{})
	gated := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
		if calls.Add(1) > gateAt {
			select {
			case <-gate:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return recordEffect(ctx, tx, ev)
	}
	r := startConsumer(t, pool, src, consumer.Config{Name: "restart-test", Concurrency: 8}, gated)

	// Mid-stream: the gate holds every handler call past gateAt of n until
	// the node is stopped.
	require.Eventually(t, func() bool { return calls.Load() > gateAt }, 120*time.Second, 5*time.Millisecond)
	node.ctl(t, "stop_app")
	stoppedAt := r.c.Stats().Handled
	close(gate)
	node.ctl(t, "start_app")
	require.Eventually(t, func() bool { return counterValue(t, rd, amqp.ReconnectsMetric) == 1 },
		60*time.Second, 10*time.Millisecond, "the source must reconnect by itself after the restart")
	waitAllEffects(t, pool, a, q, n, 120*time.Second)
	require.NoError(t, r.stop())

	requireExactlyOnce(t, pool, ids)
	st := r.c.Stats()
	assert.Zero(t, st.DeadLettered, "a broker restart is not poison")
	assert.LessOrEqual(t, st.Handled, uint64(n), "a commit whose delivery died meanwhile counts as a duplicate later")
	t.Logf("restart after %d events: received %d, handled %d, duplicates %d", stoppedAt, st.Received, st.Handled, st.Duplicates)
	requireLeftoversProcessed(t, a, q, ids)
}
