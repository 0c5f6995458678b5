package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The consumer's own steps in the database (taking a pool connection, the
// BEGIN with the claims, the recording of progress, the COMMIT, a
// rollback, the crash guard's records, the statements after a handler
// ended the transaction itself: stepAlone) are watched with
// Config.DatabaseTimeout. A connection whose server vanished without a
// word reaching the consumer's host (a failover's old primary, a
// middlebox or load balancer that dropped the connection) leaves a
// statement sent on it unanswered until the operating system gives up on
// the connection: about a quarter of an hour with Linux's defaults, while
// the stream it belongs to stands still.
//
// Taking a pool connection (pgxpool's ping of one that idled, a new
// connection's dial and startup) is bounded by DatabaseTimeout: there is
// no session yet to ask after. A step on a connection taken is not cut
// for being slow (a claim waiting for another transaction's claim of the
// same id, a COMMIT running deferred triggers or waiting for a
// synchronous standby: cut, each would fail again on its retry, some for
// ever): once it has waited DatabaseTimeout, the watchdog asks the server
// whether the connection's server process still exists (stranded.go),
// and cuts the step when it is gone, or when the server cannot be reached
// to ask. Behind a connection pooler, whose process ids are not the
// server's, every step is bounded by DatabaseTimeout.
//
// A step cut so ends with pgx closing its connection; the pool's other
// connections are closed too (leaveUnanswered), and the step fails as
// infrastructure: retried on a new connection, never charged to a
// message. A COMMIT cut so may have committed: the retry finds the claims
// committed, as duplicates, or asks the transaction's status (messages
// deduplicated by position).

// errUnanswered is the cause of a step's context that ended at
// Config.DatabaseTimeout, or that the watchdog cut after it
// (errSessionGone, errServerUnreachable wrap it).
var errUnanswered = errors.New("once: no answer from the database within Config.DatabaseTimeout")

var (
	errSessionGone       = fmt.Errorf("%w: the connection's server process is gone from the server", errUnanswered)
	errServerUnreachable = fmt.Errorf("%w: the server could not be reached to ask after the connection's session", errUnanswered)
)

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
	// cause is the step's context's: errUnanswered, errSessionGone or
	// errServerUnreachable.
	cause error
	err   error
}

func (e *unansweredError) Error() string {
	var why string
	switch {
	case errors.Is(e.cause, errSessionGone):
		why = ", and its connection's server process is gone from the server"
	case errors.Is(e.cause, errServerUnreachable):
		why = ", and the server could not be reached to ask after its connection's session"
	}
	return fmt.Sprintf("the database did not answer a step of the consumer's within DatabaseTimeout (%s)%s; the pool's connections are closed and the step retried on a new one: %v", e.limit, why, e.err)
}
func (e *unansweredError) Unwrap() error { return e.err }

// unanswered returns err, saying so when ctx, a step's context, ended at
// DatabaseTimeout (limit).
func unanswered(ctx context.Context, limit time.Duration, err error) error {
	var already *unansweredError
	cause := context.Cause(ctx)
	if err == nil || !errors.Is(cause, errUnanswered) || errors.As(err, &already) {
		return err
	}
	return &unansweredError{limit: limit, cause: cause, err: err}
}

// acquire takes a pool connection for a transaction. Waiting for a
// connection that others hold is the consumer's own time (Concurrency
// above the pool's size, or a pool the service shares), bounded by ctx
// alone; what pgxpool does once it has one (the ping it sends on a
// connection that idled, a new connection's dial and startup) is bounded
// by DatabaseTimeout.
func (p *pipeline) acquire(ctx context.Context) (*pgxpool.Conn, error) {
	for {
		sctx, endStep := p.ownStep(ctx)
		conn, err := p.pool.Acquire(sctx)
		switch {
		case err == nil:
			endStep()
			return conn, nil
		case ctx.Err() == nil && errors.Is(context.Cause(sctx), errUnanswered) && p.everyConnectionHeld():
			// Still waiting for a connection others hold.
			endStep()
			continue
		}
		err = unanswered(sctx, p.cfg.DatabaseTimeout, err)
		endStep()
		return nil, err
	}
}

// dbStep is one of the consumer's own steps on a connection taken, in
// progress: its entry in the watchdog and what ends its context. The
// steps of a transaction, one after another, share one.
type dbStep struct {
	call userCall
	// cut ends a watched step's context; cancel one bounded by
	// DatabaseTimeout alone.
	cut    context.CancelCauseFunc
	cancel context.CancelFunc
}

// stepOn begins s, a step on conn, and returns its context: watched once
// it has waited DatabaseTimeout, cut when the connection's server process
// is gone (see above); bounded by DatabaseTimeout where process ids are
// not the server's. endStep ends it.
func (p *pipeline) stepOn(ctx context.Context, conn *pgx.Conn, s *dbStep) context.Context {
	if p.cfg.DatabaseTimeout <= 0 || !p.sessions().serverPIDs {
		var sctx context.Context
		sctx, s.cancel = p.ownStep(ctx)
		return sctx
	}
	sctx, cut := context.WithCancelCause(ctx)
	s.cut = cut
	p.watch.beginStep(&s.call, conn.PgConn().PID(), cut)
	return sctx
}

// endStep ends s, begun by stepOn.
func (p *pipeline) endStep(s *dbStep) {
	if s.cut != nil {
		p.watch.end(&s.call)
		s.cut(nil)
		s.cut = nil
	}
	if s.cancel != nil {
		s.cancel()
		s.cancel = nil
	}
}

// onConn runs f on a pool connection taken by acquire, under the context
// of its step, and releases the connection: a statement of the consumer's
// own outside a transaction, watched like the transaction's steps.
func (p *pipeline) onConn(ctx context.Context, f func(ctx context.Context, conn *pgxpool.Conn) error) error {
	conn, err := p.acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	step := new(dbStep)
	sctx := p.stepOn(ctx, conn.Conn(), step)
	defer p.endStep(step)
	return unanswered(sctx, p.cfg.DatabaseTimeout, f(sctx, conn))
}

// stepAlone runs f on conn, the connection of a transaction that a
// handler's statement ended (left out of any transaction), under the
// context of a step of its own: watched like the transaction's steps (a
// connection stranded just after the handler's COMMIT held the stream
// until the operating system gave up on it). A step cut so closes the
// pool's other connections too (leaveUnanswered): the caller goes on to
// them.
func (p *pipeline) stepAlone(ctx context.Context, conn *pgx.Conn, f func(ctx context.Context, conn *pgx.Conn) error) error {
	step := new(dbStep)
	sctx := p.stepOn(ctx, conn, step)
	defer p.endStep(step)
	err := unanswered(sctx, p.cfg.DatabaseTimeout, f(sctx, conn))
	p.leaveUnanswered(err)
	return err
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
