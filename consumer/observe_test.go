package consumer_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// sums returns the int64 sum metrics by name and attribute value.
func sums(t *testing.T, r *sdkmetric.ManualReader, name, attr string) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, r.Collect(context.Background(), &rm))
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				v, _ := dp.Attributes.Value(attribute.Key(attr))
				out[v.AsString()] += dp.Value
			}
		}
	}
	return out
}

func TestMetricsAndLogs(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	var logs bytes.Buffer
	var mu sync.Mutex
	b := memsource.New(memsource.Options{Streams: 2})
	publish(b, "a", 1)
	publish(b, "a", 1)
	publish(b, "b", 2)
	const secret = "card-4111111111111111"
	b.Publish(consumer.Message{Value: []byte(`{"n": "` + secret + `"`), Headers: map[string]string{"id": "poison"}})

	cfg := fastConfig("observed")
	cfg.Telemetry.MeterProvider = mp
	cfg.Telemetry.Logger = slog.New(slog.NewTextHandler(lockedWriter{&logs, &mu}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 4 }, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())

	assert.Equal(t, map[string]int64{"handled": 2, "duplicate": 1, "dead_lettered": 1},
		sums(t, reader, "once.consumer.messages", "outcome"))
	assert.Equal(t, map[string]int64{"decode": 1}, sums(t, reader, "once.consumer.dead_letters", "kind"))

	mu.Lock()
	out := logs.String()
	mu.Unlock()
	assert.Contains(t, out, "dead-lettered", "a dead letter is logged")
	assert.NotContains(t, out, secret, "payloads never reach the logs")
}

type lockedWriter struct {
	b  *bytes.Buffer
	mu *sync.Mutex
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

// Two replicas with one consumer name receive the same events at the same
// time (as after a rebalance): each event's effect exactly once.
func TestConcurrentReplicasShareDedup(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	const n = 200
	var brokers []*memsource.Broker
	for r := 0; r < 2; r++ {
		b := memsource.New(memsource.Options{})
		for i := 0; i < n; i++ {
			publish(b, fmt.Sprintf("e%d", i), i)
		}
		brokers = append(brokers, b)
	}
	for _, b := range brokers {
		cfg := fastConfig("replicated")
		cfg.Concurrency = 4
		c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
		require.NoError(t, err)
		start(t, c)
	}
	require.Eventually(t, func() bool { return brokers[0].Acked() == n && brokers[1].Acked() == n },
		20*time.Second, 5*time.Millisecond)
	requireEffectsOnce(t, pool, n)
}

// A dead-letter destination that is down is an infrastructure failure
// like the database's: each wait before writing the dead letter again is a
// retry in once.consumer.retries{reason="infrastructure"} and in
// Stats.Retries, as OnRetry reports it, so the runbook's alert on that
// metric sees the outage.
func TestDeadLetterWriteRetriesAreCounted(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	b := memsource.New(memsource.Options{Streams: 1})
	b.Publish(consumer.Message{Value: []byte("not json"), Headers: map[string]string{"id": "poison"}})
	b.SetDeadLetterError(errors.New("dead-letter queue unavailable"))

	const outage = 3
	var hooked atomic.Int32
	cfg := fastConfig("dlq-down-counted")
	cfg.Telemetry.MeterProvider = mp
	cfg.Hooks.OnRetry = func(_ context.Context, r consumer.Retry) {
		assert.Equal(t, consumer.RetryInfrastructure, r.Reason)
		if hooked.Add(1) == outage {
			b.SetDeadLetterError(nil) // back before the next attempt
		}
	}
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return b.IsAcked(0) }, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())

	require.Equal(t, int32(outage), hooked.Load())
	st := c.Stats()
	assert.Equal(t, uint64(outage), st.InfraErrors)
	assert.Equal(t, uint64(outage), st.Retries, "Stats.Retries")
	assert.Equal(t, map[string]int64{"infrastructure": outage}, sums(t, reader, "once.consumer.retries", "reason"))
	assert.Equal(t, uint64(1), st.DeadLettered)
}

// A handler retry cut short by the shutdown (the message abandoned while
// it waits for its next attempt) never happened: neither Stats.Retries nor
// once.consumer.retries counts it, and the two agree.
func TestHandlerRetryAbandonedWhileWaitingIsNotCounted(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "later", 1)
	waiting := make(chan struct{})
	cfg := fastConfig("retry-abandoned")
	cfg.Telemetry.MeterProvider = mp
	cfg.Hooks.OnRetry = func(context.Context, consumer.Retry) { close(waiting) }
	h := func(context.Context, pgx.Tx, consumer.Event[order]) error {
		return consumer.RetryAfter(time.Hour, errors.New("not yet"))
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	<-waiting
	require.NoError(t, stop())

	assert.Zero(t, c.Stats().Retries)
	assert.Empty(t, sums(t, reader, "once.consumer.retries", "reason"))
}

// once.consumer.inflight counts the messages of the transactions in
// progress, not the transactions: one batch of five, under Concurrency 1,
// is five in flight (operations.md: up to Concurrency x Batch.Size).
func TestInflightCountsTheMessagesOfABatch(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	b := memsource.New(memsource.Options{Streams: 1})
	for i := 0; i < 5; i++ {
		publishKeyed(b, "one key", fmt.Sprintf("e%d", i), i)
	}
	cfg := fastConfig("inflight")
	cfg.Telemetry.MeterProvider = mp
	cfg.Concurrency = 1
	cfg.Batch.Size = 5
	cfg.Batch.Linger = time.Minute // until the batch is full
	inflight := make(chan int64, 5)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "e0" && ev.Attempt == 1 {
			inflight <- sumOf(t, reader, "once.consumer.inflight")
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	assert.Equal(t, int64(5), <-inflight)
	require.Eventually(t, func() bool { return b.Acked() == 5 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, int64(0), sumOf(t, reader, "once.consumer.inflight"))
}

// sumOf returns the sum of an int64 sum metric over its attributes.
func sumOf(t *testing.T, r *sdkmetric.ManualReader, name string) int64 {
	var n int64
	for _, v := range sums(t, r, name, "once.consumer") {
		n += v
	}
	return n
}
