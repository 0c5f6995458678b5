package consumer

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A handler's statement that waits for a lock another session holds (a
// migration rewriting the table, or waiting in line for its lock behind a
// long query; a long transaction) is cut at HandlerTimeout like a handler
// that hangs. The wait is not the message's doing, and charging it
// dead-letters good messages once the lock outlasts Retry.MaxAttempts
// cuts; a lock_timeout's 55P03 is infrastructure for the same reason. So
// the watchdog samples, for each handler call past half its
// HandlerTimeout, what its transaction's server process waits for, and a
// handler cut in a statement while it waited for another session is
// infrastructure: retried, never charged, and logged naming the server
// processes in the way. The same holds for a statement the sessions'
// statement_timeout canceled (57014): when it is shorter than
// HandlerTimeout, the sample starts at half of it and goes on until the
// call ends or HandlerTimeout cuts it (statement_timeout bounds each
// statement, and one that begins late in the call waits as long); and for
// the send of the statements handlers queued (Event.Queue), which only
// statement_timeout cuts, sampled past half of it until it ends.
//
// The question is asked before the cut, not after it: pgx ends a
// statement whose context ended by closing the connection with a cancel
// request, which ends the wait at once. It is asked on a connection of its
// own, opened for it with the pool's configuration: when a lock holds up
// every handler, every pooled connection is held by one.

// lockProbe is a call to be sampled for lock waits or asked after
// (stranded.go): its call, its server process and when it began (so that
// a sample lands on that call and not on the next call of the same job).
type lockProbe struct {
	c     *userCall
	pid   uint32
	start time.Time
}

// callsToSample appends to out the handler calls (sends: the sends of
// queued statements) that have run for at least from and less than to
// (past HandlerTimeout they were cut, and what they waited for then is
// what counts) and whose transaction has a server process.
func (w *watchdog) callsToSample(out []lockProbe, now time.Time, from, to time.Duration, sends bool) []lockProbe {
	w.mu.Lock()
	defer w.mu.Unlock()
	for c := w.head; c != nil; c = c.next {
		handler := c.pid != 0 && !c.send
		send := c.send && !c.step
		if running := now.Sub(c.start); (sends && send || !sends && handler) && running >= from && running < to {
			out = append(out, lockProbe{c: c, pid: c.pid, start: c.start})
		}
	}
	return out
}

// noteLockWaits records, on each probed call still running, what its
// server process waited for (nil: nothing).
func (w *watchdog) noteLockWaits(probes []lockProbe, blockers map[uint32][]uint32) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, pr := range probes {
		if w.running(pr.c) && pr.c.pid == pr.pid && pr.c.start.Equal(pr.start) {
			pr.c.lockedBy = blockers[pr.pid]
		}
	}
}

// running reports whether c is in the list of calls in progress. w.mu is
// held.
func (w *watchdog) running(c *userCall) bool {
	for x := w.head; x != nil; x = x.next {
		if x == c {
			return true
		}
	}
	return false
}

// lockedBy returns what c's server process last waited for.
func (w *watchdog) lockedBy(c *userCall) []uint32 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return c.lockedBy
}

// lockProbes returns the calls to sample for lock waits: the handler
// calls that have run for half of lockWaitLimit (HandlerTimeout, or the
// sessions' statement_timeout when shorter) and not for HandlerTimeout,
// and the sends of queued statements that have run for half of
// statement_timeout (HandlerTimeout does not cut them). With the
// watchdog's tick at a quarter of that limit at most, every call cut at
// HandlerTimeout, or in a statement at statement_timeout (which bounds
// each statement: one that began late in the call too), was sampled in
// the last quarter before its cut (a lock wait that began after it is
// charged, as before).
// With neither limit nothing is cut and nothing sampled, nor behind a
// connection pooler (readSessions), whose ids are not the server's: a cut
// there is charged.
func (p *pipeline) lockProbes(now time.Time) []lockProbe {
	if !p.sessions().serverPIDs {
		// Behind a connection pooler the ids are the pooler's: one that
		// happens to be another session's would answer for it.
		return nil
	}
	var out []lockProbe
	if limit := p.lockWaitLimit(); limit > 0 {
		// statement_timeout bounds each statement, not the call: a call
		// past it may have a statement waiting yet, and is sampled until
		// HandlerTimeout cuts it (under NoHandlerTimeout, until it ends).
		to := time.Duration(math.MaxInt64)
		if p.cfg.HandlerTimeout > 0 {
			to = p.cfg.HandlerTimeout
		}
		out = p.watch.callsToSample(out, now, limit/2, to, false)
	}
	if st := p.sessions().statementTimeout; st > 0 {
		// Each queued statement has its statement_timeout: sampled until
		// the send ends.
		out = p.watch.callsToSample(out, now, st/2, time.Duration(math.MaxInt64), true)
	}
	return out
}

// lockWaitLimit is how long a handler's statement may wait before it is
// cut: HandlerTimeout, or the sessions' statement_timeout when that is
// shorter (read at start: statementTimeout); 0 when neither cuts it.
func (p *pipeline) lockWaitLimit() time.Duration {
	limit := max(p.cfg.HandlerTimeout, 0)
	if st := p.sessions().statementTimeout; st > 0 && (limit == 0 || st < limit) {
		limit = st
	}
	return limit
}

// sessionSettings is what readSessions reads of the pool's sessions.
type sessionSettings struct {
	// statementTimeout is the sessions' statement_timeout; 0: none.
	statementTimeout time.Duration
	// serverPIDs: a connection's process id is its server process's;
	// false behind a connection pooler.
	serverPIDs bool
	// sessionEnd is the shorter of the sessions'
	// idle_in_transaction_session_timeout and transaction_timeout; 0:
	// neither.
	sessionEnd time.Duration
}

// sessions returns what readSessions read of the pool's sessions; while
// no read succeeded, nothing: no statement_timeout known, process ids not
// taken for the server's (nothing sampled or asked after).
func (p *pipeline) sessions() sessionSettings {
	if s := p.sessionsRead.Load(); s != nil {
		return *s
	}
	return sessionSettings{}
}

// readSessions reads what the watchdog's questions about the pool's
// sessions need: their statement_timeout (set for the role, the database
// or the pool's RuntimeParams), as a statement waiting for another
// session's lock that it cuts is sampled like one HandlerTimeout would cut
// (a handler's own SET statement_timeout is not seen; its cuts are
// charged); their idle_in_transaction_session_timeout and
// transaction_timeout, past which the server ends a session itself
// (stranded.go); and whether the process id a connection got at its start
// is its server process's (not so behind a connection pooler such as
// PgBouncer, which hands out ids of its own; then no session is asked
// after, see stranded.go). It is read at start; a read that fails there (a
// connection lost, a refusal) is tried again at the watchdog's next ticks
// until one succeeds (readSessionsAgain): without it no lock wait is
// sampled, and a handler cut while it waited for a migration's lock
// would be charged for the consumer's whole life. It reports whether the
// read succeeded.
func (p *pipeline) readSessions(ctx context.Context) bool {
	err := p.pool.AcquireFunc(ctx, func(conn *pgxpool.Conn) error {
		return p.readSessionsOn(ctx, conn.Conn())
	})
	if err != nil {
		p.cfg.Telemetry.Logger.DebugContext(ctx, "once: cannot read the sessions' statement_timeout and process id; tried again at the watchdog's next tick", "consumer", p.cfg.Name, "error", err)
	}
	return err == nil
}

// readSessionsAgain tries readSessions again, when no read has succeeded
// yet and the last try is at least sessionsRetryEvery old, and reports
// whether it succeeded now. It asks on a connection of its own
// (askAfterSessions), bounded by sessionCheckTimeout: when a lock holds
// up every handler, every pooled connection is held by one, and the
// watchdog waits for the answer. Only the watchdog's goroutine calls it.
func (p *pipeline) readSessionsAgain(ctx context.Context, now time.Time) bool {
	if p.sessionsRead.Load() != nil || now.Sub(p.sessionsTried) < sessionsRetryEvery {
		return false
	}
	p.sessionsTried = now
	rctx, cancel := context.WithTimeout(ctx, sessionCheckTimeout)
	defer cancel()
	err := p.askAfterSessions(rctx, func(conn *pgx.Conn) error { return p.readSessionsOn(rctx, conn) })
	if err != nil {
		p.cfg.Telemetry.Logger.DebugContext(ctx, "once: cannot read the sessions' statement_timeout and process id; tried again at the watchdog's next tick", "consumer", p.cfg.Name, "error", err)
	}
	return err == nil
}

// sessionsRetryEvery bounds how often readSessionsAgain opens a
// connection while the read keeps failing (the database down): the
// watchdog's tick may be as short as 10 ms.
const sessionsRetryEvery = time.Second

// readSessionsOn is readSessions on conn, a connection made with the
// pool's configuration.
func (p *pipeline) readSessionsOn(ctx context.Context, conn *pgx.Conn) error {
	var statement, idle, transaction int64
	var pid uint32
	// transaction_timeout is PostgreSQL 17's: NULL before it.
	err := conn.QueryRow(ctx, `SELECT
		(SELECT setting::bigint FROM pg_settings WHERE name = 'statement_timeout'),
		(SELECT setting::bigint FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'),
		coalesce((SELECT setting::bigint FROM pg_settings WHERE name = 'transaction_timeout'), 0),
		pg_backend_pid()`).Scan(&statement, &idle, &transaction, &pid)
	if err != nil {
		return err
	}
	p.sessionsRead.Store(&sessionSettings{
		statementTimeout: time.Duration(statement) * time.Millisecond,
		sessionEnd:       shorterLimit(time.Duration(idle)*time.Millisecond, time.Duration(transaction)*time.Millisecond),
		serverPIDs:       pid == conn.PgConn().PID(),
	})
	return nil
}

// blockingPIDs returns, for each of pids that waits for a lock, the
// server processes it waits for (pg_blocking_pids: those holding a
// conflicting lock, and those ahead of it in line for one), asked on conn.
func blockingPIDs(ctx context.Context, conn *pgx.Conn, pids []int32) (map[uint32][]uint32, error) {
	rows, err := conn.Query(ctx, `SELECT pid, pg_blocking_pids(pid) FROM unnest($1::int4[]) AS pid
		WHERE cardinality(pg_blocking_pids(pid)) > 0`, pids)
	if err != nil {
		return nil, err
	}
	out := map[uint32][]uint32{}
	var pid uint32
	var by []uint32
	_, err = pgx.ForEachRow(rows, []any{&pid, &by}, func() error {
		out[pid] = by
		return nil
	})
	return out, err
}

// cutInLockWait returns what the watchdog last saw the server process of
// a handler call c, cut at HandlerTimeout with err (nil: it returned nil
// after the cut), wait for, when the cut hit a statement (the connection
// closed under it); nil otherwise: a handler cut outside the database
// waited for no lock, and a panic is a bug whatever it waited for.
func (p *pipeline) cutInLockWait(c *userCall, tx *queueTx, err error) []uint32 {
	if c == nil || isPanic(err) || !tx.Conn().IsClosed() {
		return nil
	}
	return p.watch.lockedBy(c)
}

// lockWaitNote is what a timeoutError says of the lock its handler's
// statement waited for.
func lockWaitNote(blockers []uint32) string {
	if len(blockers) == 0 {
		return ""
	}
	return fmt.Sprintf(" while its statement waited for a lock of another session (server process %v: a migration, a long transaction?)", blockers)
}

// shorterLimit returns the shorter of two limits, 0 meaning none.
func shorterLimit(a, b time.Duration) time.Duration {
	if a <= 0 || (b > 0 && b < a) {
		return b
	}
	return a
}
