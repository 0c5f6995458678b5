package amqp_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// BenchmarkSource measures consumption through the Source alone, with no
// database: Receive and Ack of b.N persistent messages (the ceiling).
//
//	go test -run '^$' -bench . -benchtime 20000x ./brokers/amqp/
func BenchmarkSource(b *testing.B) {
	a := newAdmin(b)
	q := queueName(b)
	a.declare(q, amqp.QueueClassic)
	require.NoError(b, a.publish("", q, messagesFor(eventIDs("bench", b.N))...))
	src := openSource(b, amqp.Config{Queue: q, Prefetch: 256})
	ctx := context.Background()

	b.ResetTimer()
	start := time.Now()
	for range b.N {
		d, err := src.Receive(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if err := d.Ack(ctx); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msgs/s")
}

// BenchmarkConsumer measures the full consumer with its defaults (16
// workers, batches of up to 100): each message's id claimed in Postgres
// and one business row inserted by the handler in the same transaction,
// then acked.
func BenchmarkConsumer(b *testing.B) { benchConsumer(b, false, false) }

// BenchmarkConsumerOrdered is BenchmarkConsumer with Config.Ordered: the
// queue is one stream, handled in order.
func BenchmarkConsumerOrdered(b *testing.B) { benchConsumer(b, true, false) }

// BenchmarkConsumerBatchHandler is BenchmarkConsumer with a
// consumer.BatchHandler that inserts a batch's rows in one statement.
func BenchmarkConsumerBatchHandler(b *testing.B) { benchConsumer(b, false, true) }

func benchConsumer(b *testing.B, ordered, batchHandler bool) {
	a := newAdmin(b)
	q := queueName(b)
	a.declare(q, amqp.QueueClassic)
	require.NoError(b, a.publish("", q, messagesFor(eventIDs("bench", b.N))...))
	pool := effectsDB(b)
	src := openSource(b, amqp.Config{Queue: q, Prefetch: 256, Ordered: ordered})
	cfg := consumer.Config{Name: "bench", Telemetry: consumer.TelemetryConfig{Logger: testLogger(b)}}

	b.ResetTimer()
	start := time.Now()
	var c *consumer.Consumer[payload]
	var err error
	if batchHandler {
		c, err = consumer.NewBatch(pool, src, insertEffects, cfg)
	} else {
		c, err = consumer.New(pool, src, recordEffect, cfg)
	}
	require.NoError(b, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = c.Run(ctx) }()
	tick := time.NewTicker(time.Millisecond)
	for c.Stats().Handled < uint64(b.N) {
		<-tick.C // polls the counter while the measured work runs
	}
	elapsed := time.Since(start)
	b.StopTimer()
	tick.Stop()
	cancel()
	wg.Wait()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
}

// insertEffects writes a batch's effects with one multi-row statement.
func insertEffects(ctx context.Context, tx pgx.Tx, evs []consumer.Event[payload]) error {
	ids := make([]string, len(evs))
	attempts := make([]int32, len(evs))
	for i, ev := range evs {
		ids[i], attempts[i] = ev.ID, int32(ev.Attempt)
	}
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, attempt) SELECT * FROM unnest($1::text[], $2::int[])`, ids, attempts)
	return err
}
