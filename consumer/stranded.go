package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The statements handlers queue (Event.Queue) are sent after the handlers
// return, one round trip before the COMMIT, and a handler's own statements
// are sent while it runs. They are the handlers' work and may be slow on
// their own, as the consumer's own steps may be (dbstep.go), so
// DatabaseTimeout does not cut them; but on a connection whose server
// vanished without a word (a failover's old primary, a middlebox that
// dropped the connection) their answer never comes: a send of queued
// statements waited until the operating system gave up on the connection
// (about a quarter of an hour with Linux's defaults), the stream standing
// still, and a handler's statement until HandlerTimeout cut it, charged
// to the message.
// So the watchdog asks, for a send of queued statements that has waited
// DatabaseTimeout for its answer, and for a handler call that has run that
// long, whether the transaction's server process still exists on the
// server (pg_stat_activity, on a connection opened for the question). A
// server process gone, or one of that id outside any transaction (another
// session that got the id since), means no answer will come: the call is
// cut (its context ends, and pgx closes the connection under a statement),
// the pool's other connections are closed (as for an unanswered step of
// the consumer's own), and the transaction retried as infrastructure,
// never charged. A statement that is slow, or waits for a lock, runs on:
// its server process is there, in its transaction. The consumer's own
// steps are asked after the same way, and cut also when the server cannot
// be reached to ask.
//
// The server also ends sessions of its own accord: past
// idle_in_transaction_session_timeout or transaction_timeout, which
// readSessions reads at start. It tells the client so, but a handler
// working outside the database learns it only at its next statement, and
// that failure is the handler's (transactionTimeRanOut). So a handler call
// whose transaction is older than the shorter of the two is not cut: its
// server process may have gone for that. A send waits for its answer: a
// session the server ended answers at once.
//
// Behind a connection pooler the id a connection gets at its start is not
// its server process's (readSessions finds that at start), and nothing is
// asked: the operating system's bound, or HandlerTimeout, stands.

// queuedCall names a send of queued statements in the watchdog's log.
const queuedCall = "Event.Queue statements"

// sessionCheckTimeout bounds one sample's connection and questions.
const sessionCheckTimeout = 2 * time.Second

// strandedError is the failure of a send of queued statements, or of a
// handler, that the watchdog cut because the transaction's server process
// was gone.
type strandedError struct {
	waited time.Duration
	err    error
}

func (e *strandedError) Error() string {
	return fmt.Sprintf("the transaction's server process is gone from the server without a word reaching this host (a failover, a dropped connection), found after %s; the pool's connections are closed and the transaction retried on a new one: %v", e.waited.Round(time.Millisecond), e.err)
}
func (e *strandedError) Unwrap() error { return e.err }

// flushQueued sends the statements the handlers queued (queueTx.flush)
// and returns the first failure: a send the watchdog cut because its
// server process was gone is a strandedError, and one statement_timeout
// canceled while the watchdog last saw it wait for another session's lock
// a canceledInLockWaitError.
func (p *pipeline) flushQueued(ctx context.Context, qtx *queueTx) *queueFailure {
	s := p.sessions()
	watched := s.serverPIDs && (p.cfg.DatabaseTimeout > 0 || s.statementTimeout > 0)
	if len(qtx.pending.QueuedQueries) == 0 || !watched {
		return qtx.flush(ctx)
	}
	fctx, cut := context.WithCancel(ctx)
	defer cut()
	c := &qtx.sending
	p.watch.beginSend(c, queuedCall, qtx.Conn().PgConn().PID(), cut)
	f := qtx.flush(fctx)
	p.watch.end(c)
	switch {
	case f == nil || ctx.Err() != nil:
	case p.watch.wasStranded(c):
		f.err = &strandedError{waited: time.Since(c.start), err: f.err}
	case sqlState(f.err) == queryCanceled:
		// statement_timeout, on a statement the watchdog last saw
		// waiting for another session's lock (lockwait.go).
		if by := p.watch.lockedBy(c); len(by) > 0 {
			f.err = &canceledInLockWaitError{err: f.err, lockedBy: by}
		}
	}
	return f
}

// asksAfterSessions reports whether the watchdog asks the server after a
// send of queued statements that waits long, or a handler call that runs
// long: with a DatabaseTimeout, and connections whose process ids are
// their server processes'.
func (p *pipeline) asksAfterSessions() bool {
	return p.cfg.DatabaseTimeout > 0 && p.sessions().serverPIDs
}

// callsToAsk returns the calls that may be cut (sends, and handler calls)
// that have run for at least after and were not cut
// yet; not a handler call whose transaction has run for sessionEnd (the
// shorter of idle_in_transaction_session_timeout and transaction_timeout;
// 0: neither), whose server process the server may have ended itself.
func (w *watchdog) callsToAsk(now time.Time, after, sessionEnd time.Duration) []lockProbe {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []lockProbe
	for c := w.head; c != nil; c = c.next {
		if (c.cut == nil && c.cutCause == nil) || c.stranded || c.pid == 0 || now.Sub(c.start) < after {
			continue
		}
		if !c.send && sessionEnd > 0 && now.Sub(c.txBegan) >= sessionEnd {
			continue
		}
		out = append(out, lockProbe{c: c, pid: c.pid, start: c.start})
	}
	return out
}

// wasStranded reports whether the watchdog cut c because its server
// process was gone.
func (w *watchdog) wasStranded(c *userCall) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return c.stranded
}

// cutStranded cuts each probed call still in progress whose server
// process is not among alive, as answered at answered, and marks it
// stranded; not a handler call whose transaction had run for sessionEnd
// (0: no such limit) by then: the server may have ended its process for
// that after callsToAsk chose it, before the answer.
func (w *watchdog) cutStranded(probes []lockProbe, alive map[uint32]bool, answered time.Time, sessionEnd time.Duration) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, pr := range probes {
		if alive[pr.pid] || (!pr.c.send && sessionEnd > 0 && answered.Sub(pr.c.txBegan) >= sessionEnd) {
			continue
		}
		w.cutCall(pr, errSessionGone)
	}
}

// cutSteps cuts each probed step of the consumer's own still in progress:
// the server could not be reached to ask after its session.
func (w *watchdog) cutSteps(probes []lockProbe) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, pr := range probes {
		if pr.c.step {
			w.cutCall(pr, errServerUnreachable)
		}
	}
}

// cutCall cuts the probed call, when it is still in progress, with cause
// (a step's), and marks it stranded. w.mu is held.
func (w *watchdog) cutCall(pr lockProbe, cause error) {
	if !w.running(pr.c) || pr.c.pid != pr.pid || !pr.c.start.Equal(pr.start) {
		return
	}
	pr.c.stranded = true
	if pr.c.cutCause != nil {
		pr.c.cutCause(cause)
	} else {
		pr.c.cut()
	}
}

// sampleSessions asks the database, on one connection opened for the
// questions, about the server processes of the calls in progress that
// need it: what the handler calls past half of lockWaitLimit wait for
// (lockwait.go), and whether those of the sends and handler calls that
// have run for DatabaseTimeout still exist (above).
func (p *pipeline) sampleSessions(ctx context.Context, now time.Time) {
	locks := p.lockProbes(now)
	var waits []lockProbe
	if p.asksAfterSessions() {
		waits = p.watch.callsToAsk(now, p.cfg.DatabaseTimeout, p.sessions().sessionEnd)
	}
	if len(locks) == 0 && len(waits) == 0 {
		return
	}
	// Not shorter on a short tick: a question that timed out would cut
	// the consumer's steps waiting for an answer (cutSteps).
	qctx, cancel := context.WithTimeout(ctx, sessionCheckTimeout)
	defer cancel()
	err := p.askAfterSessions(qctx, func(conn *pgx.Conn) error {
		if len(locks) > 0 {
			blockers, err := blockingPIDs(qctx, conn, probePIDs(locks))
			if err != nil {
				return err
			}
			p.watch.noteLockWaits(locks, blockers)
		}
		if len(waits) > 0 {
			alive, err := inTransaction(qctx, conn, probePIDs(waits))
			if err != nil {
				return err
			}
			p.watch.cutStranded(waits, alive, time.Now(), p.sessions().sessionEnd)
		}
		return nil
	})
	if err == nil || ctx.Err() != nil {
		// Answered, or the watchdog stops: nothing is cut for a question
		// it did not wait for.
		return
	}
	p.cfg.Telemetry.Logger.DebugContext(ctx, "once: could not ask the database after the sessions of long-running calls", "consumer", p.cfg.Name, "error", err)
	if !errors.As(err, new(*pgconn.PgError)) {
		// Not even a refusal from the server: what has waited that long
		// for it is cut, as DatabaseTimeout alone would have. (A handler
		// or a send of the handlers' statements may still be slow on
		// its own: they run on.)
		p.watch.cutSteps(waits)
	}
}

// askAfterSessions runs f on a connection opened for it with the pool's
// configuration, its BeforeConnect applied (a password from a token that
// expires): when a lock holds up every handler, every pooled connection
// is held by one, and a stranded pool's connections would not answer.
func (p *pipeline) askAfterSessions(ctx context.Context, f func(*pgx.Conn) error) error {
	conn, err := p.connectAlone(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	return f(conn)
}

// connectAlone opens a connection outside the pool with the pool's
// configuration, its BeforeConnect applied.
func (p *pipeline) connectAlone(ctx context.Context) (*pgx.Conn, error) {
	cfg := p.pool.Config()
	if cfg.BeforeConnect != nil {
		if err := cfg.BeforeConnect(ctx, cfg.ConnConfig); err != nil {
			return nil, err
		}
	}
	return pgx.ConnectConfig(ctx, cfg.ConnConfig)
}

// probePIDs returns the server processes of probes.
func probePIDs(probes []lockProbe) []int32 {
	pids := make([]int32, len(probes))
	for i, pr := range probes {
		pids[i] = int32(pr.pid)
	}
	return pids
}

// inTransaction returns which of pids are server processes in a
// transaction (or whose state conn may not see: a session of another
// role), asked on conn. A call's transaction is open on the server until
// the consumer ends it: a process of its id that is idle is another
// session's that got the id since.
func inTransaction(ctx context.Context, conn *pgx.Conn, pids []int32) (map[uint32]bool, error) {
	rows, err := conn.Query(ctx, `SELECT a.pid FROM pg_stat_activity a
		WHERE a.pid = ANY($1::int4[]) AND a.state IS DISTINCT FROM 'idle'`, pids)
	if err != nil {
		return nil, err
	}
	alive := map[uint32]bool{}
	var pid uint32
	_, err = pgx.ForEachRow(rows, []any{&pid}, func() error {
		alive[pid] = true
		return nil
	})
	return alive, err
}

// isStranded reports whether err is the failure of a call cut because its
// server process was gone.
func isStranded(err error) bool {
	return errors.As(err, new(*strandedError))
}
