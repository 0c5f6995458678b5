package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// The same workload for every row: b.N events over 4 streams, 10% of them
// published twice, ~200-byte payloads, one business row per event.
func benchBroker(b *testing.B) (*memsource.Broker, int) {
	br := memsource.New(memsource.Options{Streams: 4})
	pad := make([]byte, 150)
	for i := range pad {
		pad[i] = 'x'
	}
	total := 0
	for i := 0; i < b.N; i++ {
		v, _ := json.Marshal(map[string]any{"n": i, "pad": string(pad)})
		m := consumer.Message{Key: []byte(fmt.Sprint(i % 64)), Value: v, Headers: map[string]string{"id": fmt.Sprintf("e%d", i)}}
		br.Publish(m)
		total++
		if i%10 == 0 {
			br.Publish(m)
			total++
		}
	}
	return br, total
}

func benchTable(b *testing.B, pool *pgxpool.Pool) {
	if _, err := pool.Exec(context.Background(), `CREATE TABLE effects (event_id text NOT NULL, n int NOT NULL, seq bigserial)`); err != nil {
		b.Fatal(err)
	}
}

func report(b *testing.B, start time.Time, total int) {
	b.ReportMetric(float64(total)/time.Since(start).Seconds(), "msgs/s")
}

// BenchmarkCeiling: receive and ack, no database.
func BenchmarkCeiling(b *testing.B) {
	br, total := benchBroker(b)
	src := br.Source()
	ctx := context.Background()
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < total; i++ {
		d, err := src.Receive(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if err := d.Ack(ctx); err != nil {
			b.Fatal(err)
		}
	}
	report(b, start, total)
}

// BenchmarkNaive: the pattern most articles show: per message, a
// transaction that SELECTs the id, then INSERTs it and the business row.
func BenchmarkNaive(b *testing.B) {
	pool, _ := pgtest.Schema(b)
	benchTable(b, pool)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE seen (id text PRIMARY KEY)`); err != nil {
		b.Fatal(err)
	}
	br, total := benchBroker(b)
	src := br.Source()
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < total; i++ {
		d, err := src.Receive(ctx)
		if err != nil {
			b.Fatal(err)
		}
		m := d.Message()
		id := m.Headers["id"]
		var v struct{ N int }
		_ = json.Unmarshal(m.Value, &v)
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var one int
			err := tx.QueryRow(ctx, `SELECT 1 FROM seen WHERE id = $1`, id).Scan(&one)
			if err == nil {
				return nil
			}
			if !errors.Is(err, pgx.ErrNoRows) {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO seen VALUES ($1)`, id); err != nil {
				return err
			}
			_, err = tx.Exec(ctx, `INSERT INTO effects (event_id, n) VALUES ($1, $2)`, id, v.N)
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
		if err := d.Ack(ctx); err != nil {
			b.Fatal(err)
		}
	}
	report(b, start, total)
}

func benchOnce(b *testing.B, batch int) {
	pool, _ := pgtest.Schema(b)
	benchTable(b, pool)
	br, total := benchBroker(b)
	cfg := consumer.Config{Name: "bench", Batch: consumer.BatchConfig{Size: batch}, Concurrency: 4}
	c, err := consumer.New(pool, br.Source(), insertEffect, cfg)
	if err != nil {
		b.Fatal(err)
	}
	runBench(b, c, pool, br, total)
}

// runBench runs c until every message is acked and checks the effects.
func runBench(b *testing.B, c *consumer.Consumer[order], pool *pgxpool.Pool, br *memsource.Broker, total int) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	b.ResetTimer()
	start := time.Now()
	go func() { done <- c.Run(ctx) }()
	for br.Acked() < total {
		time.Sleep(time.Millisecond) // polling the benchmark's end, not synchronising a test
	}
	report(b, start, total)
	b.StopTimer()
	cancel()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	var rows int
	if err := pool.QueryRow(context.Background(), `SELECT count(DISTINCT event_id) FROM effects`).Scan(&rows); err != nil || rows != b.N {
		b.Fatalf("effects: %d distinct, want %d (err %v)", rows, b.N, err)
	}
}

// BenchmarkOncePerMessage: the library, one transaction per message.
func BenchmarkOncePerMessage(b *testing.B) { benchOnce(b, 1) }

// BenchmarkOnceBatched: the library, batches of up to 100 per stream.
func BenchmarkOnceBatched(b *testing.B) { benchOnce(b, 100) }

// BenchmarkOnceBatchHandler: the library, batches of up to 100 per stream,
// written by a BatchHandler with one multi-row statement.
func BenchmarkOnceBatchHandler(b *testing.B) {
	pool, _ := pgtest.Schema(b)
	benchTable(b, pool)
	br, total := benchBroker(b)
	c, err := consumer.NewBatch(pool, br.Source(), insertEffects, consumer.Config{Name: "bench", Batch: consumer.BatchConfig{Size: 100}, Concurrency: 4})
	if err != nil {
		b.Fatal(err)
	}
	runBench(b, c, pool, br, total)
}
