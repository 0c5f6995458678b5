package consumer

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/onceco/once/internal/pgtest"
)

// A handler passing its own context on to its statements, as nearly every
// handler does, pays no allocation per statement for the consumer's watch
// of a context it cancels itself (sawCut): only results read under one
// are wrapped. (Was: each Query, QueryRow and SendBatch allocated a
// wrapper, one more allocation per statement on the hot path than Exec.)
func TestResultsReadUnderTheHandlersContextAreNotWrapped(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	ctx, cancel := context.WithCancel(context.Background()) // the handler's
	defer cancel()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	qtx := newQueueTx(tx)
	qtx.handlerDone = ctx.Done() // as callHandler sets it
	stmts := map[string]func(pgx.Tx) error{
		"Exec": func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `SELECT 1`)
			return err
		},
		"QueryRow": func(tx pgx.Tx) error {
			var n int
			return tx.QueryRow(ctx, `SELECT 1`).Scan(&n)
		},
		"Query": func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, `SELECT 1`)
			if err != nil {
				return err
			}
			rows.Close()
			return rows.Err()
		},
		"SendBatch": func(tx pgx.Tx) error {
			var b pgx.Batch
			b.Queue(`SELECT 1`)
			return tx.SendBatch(ctx, &b).Close()
		},
	}
	// extra is what going through the consumer's transaction adds to a
	// statement's allocations.
	extra := func(run func(pgx.Tx) error) float64 {
		through := testing.AllocsPerRun(50, func() {
			if err := run(qtx); err != nil {
				t.Fatal(err)
			}
		})
		bare := testing.AllocsPerRun(50, func() {
			if err := run(tx); err != nil {
				t.Fatal(err)
			}
		})
		return through - bare
	}
	base := extra(stmts["Exec"])
	for _, name := range []string{"QueryRow", "Query", "SendBatch"} {
		if got := extra(stmts[name]); got != base {
			t.Errorf("%s through the consumer's transaction: %v allocations more than on the bare one, want %v as for Exec", name, got, base)
		}
	}
}
