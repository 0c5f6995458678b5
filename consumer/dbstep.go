package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// The consumer's own steps in the database (taking a pool connection, the
// BEGIN with the claims, the recording of progress, the COMMIT, a
// rollback, the crash guard's records) are bounded by
// Config.DatabaseTimeout. A connection whose server vanished without a
// word reaching the consumer's host (a failover's old primary, a
// middlebox or load balancer that dropped the connection) leaves a
// statement sent on it unanswered until the operating system gives up on
// the connection: about a quarter of an hour with Linux's defaults, while
// the stream it belongs to stands still. Past DatabaseTimeout pgx ends
// the statement by closing the connection, the pool's other connections
// are closed too (leaveUnanswered), and the step fails as infrastructure:
// retried on a new connection, never charged to a message. A COMMIT cut
// so may have committed: the retry finds the claims committed, as
// duplicates, or asks the transaction's status (messages deduplicated by
// position).

// errUnanswered is the cause of a context that ended at
// Config.DatabaseTimeout.
var errUnanswered = errors.New("once: no answer from the database within Config.DatabaseTimeout")

// ownStep returns ctx bounded by Config.DatabaseTimeout, for one of the
// consumer's own steps in the database, and the function that ends it.
func (p *pipeline) ownStep(ctx context.Context) (context.Context, context.CancelFunc) {
	if p.cfg.DatabaseTimeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeoutCause(ctx, p.cfg.DatabaseTimeout, errUnanswered)
}

// unansweredError is a step of the consumer's in the database that
// DatabaseTimeout cut.
type unansweredError struct {
	limit time.Duration
	err   error
}

func (e *unansweredError) Error() string {
	return fmt.Sprintf("the database did not answer within DatabaseTimeout (%s); the pool's connections are closed and the step retried on a new one: %v", e.limit, e.err)
}
func (e *unansweredError) Unwrap() error { return e.err }

// unanswered returns err, saying so when ctx, a step's context, ended at
// DatabaseTimeout (limit).
func unanswered(ctx context.Context, limit time.Duration, err error) error {
	var already *unansweredError
	if err == nil || !errors.Is(context.Cause(ctx), errUnanswered) || errors.As(err, &already) {
		return err
	}
	return &unansweredError{limit: limit, err: err}
}

// acquire takes a pool connection for a transaction, and returns it with
// the context of the transaction's first step (BEGIN with the claims) and
// the function that ends that context. Waiting for a connection that
// others hold is the consumer's own time (Concurrency above the pool's
// size, or a pool the service shares), bounded by ctx alone; what pgxpool
// does once it has one (the ping it sends on a connection that idled, a
// new connection's dial and startup) is part of the first step, bounded by
// DatabaseTimeout.
func (p *pipeline) acquire(ctx context.Context) (*pgxpool.Conn, context.Context, context.CancelFunc, error) {
	for {
		sctx, endStep := p.ownStep(ctx)
		start := time.Now()
		conn, err := p.pool.Acquire(sctx)
		switch {
		case err == nil:
			if p.cfg.DatabaseTimeout > 0 && time.Since(start) > p.cfg.DatabaseTimeout/2 {
				// A long wait for a connection: the step gets its whole
				// time.
				endStep()
				sctx, endStep = p.ownStep(ctx)
			}
			return conn, sctx, endStep, nil
		case ctx.Err() == nil && errors.Is(context.Cause(sctx), errUnanswered) && p.everyConnectionHeld():
			// Still waiting for a connection others hold.
			endStep()
			continue
		}
		err = unanswered(sctx, p.cfg.DatabaseTimeout, err)
		endStep()
		return nil, nil, nil, err
	}
}

// onConn runs f on a pool connection taken by acquire, under the context
// of its step, and releases the connection: a statement of the consumer's
// own outside a transaction, bounded like the transaction's steps.
func (p *pipeline) onConn(ctx context.Context, f func(ctx context.Context, conn *pgxpool.Conn) error) error {
	conn, sctx, endStep, err := p.acquire(ctx)
	if err != nil {
		return err
	}
	defer endStep()
	defer conn.Release()
	return unanswered(sctx, p.cfg.DatabaseTimeout, f(sctx, conn))
}

// leaveUnanswered closes the pool's connections when err is a step that
// went unanswered for DatabaseTimeout: what stranded its connection (a
// failover, a middlebox that dropped its connections) has most likely
// stranded the pool's others too, and each would cost a later step its
// DatabaseTimeout in turn. Idle connections are closed at once, those in
// use when they are released (pgxpool.Pool.Reset); the retry opens a new
// one.
func (p *pipeline) leaveUnanswered(err error) {
	var unanswered *unansweredError
	if errors.As(err, &unanswered) || isStranded(err) {
		p.pool.Reset()
	}
}

// everyConnectionHeld reports whether every connection the pool may open
// is held.
func (p *pipeline) everyConnectionHeld() bool {
	st := p.pool.Stat()
	return st.AcquiredConns() >= st.MaxConns()
}
