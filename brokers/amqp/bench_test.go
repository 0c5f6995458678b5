package amqp_test

import (
	"context"
	"testing"
	"time"

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

// BenchmarkConsumer measures the full consumer: each message claimed in
// Postgres with one business row written in the same transaction, then
// acked; deliveries are handled concurrently (16 workers), one
// transaction each.
func BenchmarkConsumer(b *testing.B) { benchConsumer(b, false) }

// BenchmarkConsumerOrdered is BenchmarkConsumer with Config.Ordered: one
// stream, handled in order in batches of up to 100 messages per
// transaction.
func BenchmarkConsumerOrdered(b *testing.B) { benchConsumer(b, true) }

func benchConsumer(b *testing.B, ordered bool) {
	a := newAdmin(b)
	q := queueName(b)
	a.declare(q, amqp.QueueClassic)
	require.NoError(b, a.publish("", q, messagesFor(eventIDs("bench", b.N))...))
	pool := effectsDB(b)
	src := openSource(b, amqp.Config{Queue: q, Prefetch: 256, Ordered: ordered})

	b.ResetTimer()
	start := time.Now()
	r := startConsumer(b, pool, src, consumer.Config{Name: "bench", Concurrency: 16}, recordEffect)
	for r.c.Stats().Handled < uint64(b.N) {
		time.Sleep(time.Millisecond) // polling the counter; the measured work runs meanwhile
	}
	elapsed := time.Since(start)
	b.StopTimer()
	require.NoError(b, r.stop())
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
}
