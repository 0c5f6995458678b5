package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// The statements handlers queue (Event.Queue) are sent after the handlers
// return, one round trip before the COMMIT. They are the handlers' work
// and may be slow on their own, so DatabaseTimeout does not cut them as it
// cuts the consumer's own steps; but on a connection whose server
// vanished without a word (a failover's old primary, a middlebox that
// dropped the connection) their answer never comes, and only the
// operating system ended the wait: about a quarter of an hour with
// Linux's defaults, the stream standing still. So the watchdog asks, for
// a send of queued statements that has waited DatabaseTimeout for its
// answer, whether the transaction's server process still exists on the
// server (pg_stat_activity, on a connection opened for the question). A
// server process gone, or one of that id outside any transaction (another
// session that got the id since), means no answer will come: the send is
// cut, its connection closed, the pool's others with it (as for an
// unanswered step of the consumer's own), and the transaction retried as
// infrastructure, never charged. A statement that is slow, or waits for a
// lock, runs on: its server process is there, in its transaction.
//
// Behind a connection pooler the id a connection gets at its start is not
// its server process's (readSessions finds that at start), and nothing is
// asked: the operating system's bound stands.

// queuedCall names a send of queued statements in the watchdog's log.
const queuedCall = "Event.Queue statements"

// sessionCheckTimeout bounds one sample's connection and questions.
const sessionCheckTimeout = 2 * time.Second

// strandedError is the failure of a send of queued statements the
// watchdog cut because the transaction's server process was gone.
type strandedError struct {
	waited time.Duration
	err    error
}

func (e *strandedError) Error() string {
	return fmt.Sprintf("no answer for %s, and the transaction's server process is gone from the server (a failover, a dropped connection); the pool's connections are closed and the transaction retried on a new one: %v", e.waited, e.err)
}
func (e *strandedError) Unwrap() error { return e.err }

// flushQueued sends the statements the handlers queued (queueTx.flush)
// and returns the first failure: a send the watchdog cut because its
// server process was gone is a strandedError.
func (p *pipeline) flushQueued(ctx context.Context, qtx *queueTx) *queueFailure {
	if len(qtx.pending.QueuedQueries) == 0 || !p.asksAfterSessions() {
		return qtx.flush(ctx)
	}
	fctx, cut := context.WithCancel(ctx)
	defer cut()
	c := &qtx.sending
	p.watch.beginSend(c, queuedCall, qtx.Conn().PgConn().PID(), cut)
	f := qtx.flush(fctx)
	p.watch.end(c)
	if f != nil && c.stranded && ctx.Err() == nil {
		f.err = &strandedError{waited: time.Since(c.start), err: f.err}
	}
	return f
}

// asksAfterSessions reports whether the watchdog asks the server after a
// send of queued statements that waits long: with a DatabaseTimeout, and
// connections whose process ids are their server processes'.
func (p *pipeline) asksAfterSessions() bool {
	return p.cfg.DatabaseTimeout > 0 && p.serverPIDs
}

// sendsToAsk returns the sends that have waited for their answer for at
// least after and were not cut yet.
func (w *watchdog) sendsToAsk(now time.Time, after time.Duration) []lockProbe {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []lockProbe
	for c := w.head; c != nil; c = c.next {
		if c.cut != nil && !c.stranded && c.pid != 0 && now.Sub(c.start) >= after {
			out = append(out, lockProbe{c: c, pid: c.pid, start: c.start})
		}
	}
	return out
}

// cutStranded cuts each probed send still waiting whose server process
// is not among alive, and marks it stranded.
func (w *watchdog) cutStranded(probes []lockProbe, alive map[uint32]bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, pr := range probes {
		if !alive[pr.pid] && w.running(pr.c) && pr.c.pid == pr.pid && pr.c.start.Equal(pr.start) {
			pr.c.stranded = true
			pr.c.cut()
		}
	}
}

// sampleSessions asks the database, on one connection opened for the
// questions, about the server processes of the calls in progress that
// need it: what the handler calls past half of lockWaitLimit wait for
// (lockwait.go), and whether those of the sends of queued statements that
// have waited DatabaseTimeout still exist (above).
func (p *pipeline) sampleSessions(ctx context.Context, now time.Time, tick time.Duration) {
	locks := p.lockProbes(now)
	var sends []lockProbe
	if p.asksAfterSessions() {
		sends = p.watch.sendsToAsk(now, p.cfg.DatabaseTimeout)
	}
	if len(locks) == 0 && len(sends) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, min(sessionCheckTimeout, max(tick, 100*time.Millisecond)))
	defer cancel()
	err := p.askAfterSessions(ctx, func(conn *pgx.Conn) error {
		if len(locks) > 0 {
			blockers, err := blockingPIDs(ctx, conn, probePIDs(locks))
			if err != nil {
				return err
			}
			p.watch.noteLockWaits(locks, blockers)
		}
		if len(sends) > 0 {
			alive, err := inTransaction(ctx, conn, probePIDs(sends))
			if err != nil {
				return err
			}
			p.watch.cutStranded(sends, alive)
		}
		return nil
	})
	if err != nil {
		p.cfg.Telemetry.Logger.DebugContext(ctx, "once: could not ask the database after the sessions of long-running calls", "consumer", p.cfg.Name, "error", err)
	}
}

// askAfterSessions runs f on a connection opened for it with the pool's
// configuration, its BeforeConnect applied (a password from a token that
// expires): when a lock holds up every handler, every pooled connection
// is held by one, and a stranded pool's connections would not answer.
func (p *pipeline) askAfterSessions(ctx context.Context, f func(*pgx.Conn) error) error {
	cfg := p.pool.Config()
	if cfg.BeforeConnect != nil {
		if err := cfg.BeforeConnect(ctx, cfg.ConnConfig); err != nil {
			return err
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	return f(conn)
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
// role), asked on conn. A send waiting for its answer is in a transaction
// on the server while it runs, and after: a process of its id that is
// idle is another session's that got the id since.
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

// isStranded reports whether err is the failure of a send cut because its
// server process was gone.
func isStranded(err error) bool {
	return errors.As(err, new(*strandedError))
}
