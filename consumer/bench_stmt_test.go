package consumer_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// BenchmarkHandlerStatement measures what the consumer's transaction adds
// to one statement of a handler's, by kind, run as the consumer runs a
// handler (consumer.Call) on one open transaction: the allocations per
// statement beside pgx's own.
func BenchmarkHandlerStatement(b *testing.B) {
	pool, _ := pgtest.Schema(b)
	// A context that can be canceled, as the handler's is.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, bc := range []struct {
		name string
		h    consumer.Handler[order]
	}{
		{"Exec", func(ctx context.Context, tx pgx.Tx, _ consumer.Event[order]) error {
			_, err := tx.Exec(ctx, `SELECT 1`)
			return err
		}},
		{"QueryRow", func(ctx context.Context, tx pgx.Tx, _ consumer.Event[order]) error {
			var n int
			return tx.QueryRow(ctx, `SELECT 1`).Scan(&n)
		}},
		{"Query", func(ctx context.Context, tx pgx.Tx, _ consumer.Event[order]) error {
			rows, err := tx.Query(ctx, `SELECT 1`)
			if err != nil {
				return err
			}
			rows.Close()
			return rows.Err()
		}},
		{"SendBatch", func(ctx context.Context, tx pgx.Tx, _ consumer.Event[order]) error {
			var batch pgx.Batch
			batch.Queue(`SELECT 1`)
			return tx.SendBatch(ctx, &batch).Close()
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				b.Fatal(err)
			}
			defer func() { _ = tx.Rollback(ctx) }()
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := consumer.Call(ctx, tx, bc.h, consumer.Event[order]{ID: "e"}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkOnceQueryRow: the library, one transaction per message, whose
// handler reads a row before writing its effect.
func BenchmarkOnceQueryRow(b *testing.B) {
	pool, _ := pgtest.Schema(b)
	benchTable(b, pool)
	br, total := benchBroker(b)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		var n int
		if err := tx.QueryRow(ctx, `SELECT 1`).Scan(&n); err != nil {
			return err
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, br.Source(), h, consumer.Config{Name: "bench", Concurrency: 4})
	if err != nil {
		b.Fatal(err)
	}
	runBench(b, c, pool, br, total)
}
