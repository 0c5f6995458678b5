package pgtest

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// StallOnce is a pgx query tracer (pgx.ConnConfig.Tracer) that holds the
// client up once, for Stall, after the first statement it sees end inside
// a transaction: as a busy machine, a garbage collection or a paused VM
// holds a process up between two statements. It is safe for concurrent
// use by the pool's connections.
type StallOnce struct {
	Stall time.Duration
	done  atomic.Bool
}

// TraceQueryStart does nothing.
func (s *StallOnce) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

// TraceQueryEnd stalls the first time a statement ends inside a
// transaction.
func (s *StallOnce) TraceQueryEnd(_ context.Context, conn *pgx.Conn, _ pgx.TraceQueryEndData) {
	if conn.PgConn().TxStatus() == 'T' && s.done.CompareAndSwap(false, true) {
		time.Sleep(s.Stall)
	}
}

// Stalled reports whether the stall happened.
func (s *StallOnce) Stalled() bool { return s.done.Load() }
