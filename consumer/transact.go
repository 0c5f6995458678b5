package consumer

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/dedup"
)

// Claim and run is the pipeline's third stage: one transaction for a run
// of jobs (a single message is a run of one). BEGIN and the claim of every
// id share one round trip; the handlers run in turn (or the BatchHandler
// once), their queued statements are sent, and one commit makes the claims
// and the effects durable together.

// txOutcome is how a transaction ended.
type txOutcome int

const (
	// txCommitted: claims and effects committed; txResult.claims holds
	// each job's claim outcome.
	txCommitted txOutcome = iota
	// txInfra: an infrastructure failure; nothing committed, try again.
	txInfra
	// txFailed: the job at txResult.failed failed (its handler, a
	// statement it queued, or the commit of a run of one): nothing
	// committed.
	txFailed
	// txUnpinned: a failure that names no job (a BatchHandler's error, a
	// queued statement the server could not prepare, a commit refused
	// after a swallowed error): nothing committed; halve the run.
	txUnpinned
	// txAbandoned: the consumer is stopping or a delivery was lost;
	// rolled back.
	txAbandoned
)

type txResult struct {
	outcome txOutcome
	claims  []dedup.Result
	failed  int
	err     error
	class   ErrorClass
	// doneBefore (txFailed): the jobs before the failed one are committed
	// (a handler's own COMMIT), with their claims' outcomes in claims.
	doneBefore bool
	// lost (txInfra): the transaction's connection was lost after its
	// claims, while the handlers' work, its queued statements or its
	// commit were under way (see sessionLost). Its messages then run
	// alone, as suspects.
	lost bool
}

// transact runs jobs in one transaction. A suspect runs alone and
// isolated (see crashGuard).
func (p *pipeline) transact(ctx context.Context, jobs []*job) txResult {
	var suspect *job
	if len(jobs) == 1 && jobs[0].guard.suspect {
		suspect = jobs[0]
	}
	if err := p.guard.enter(ctx, suspect); err != nil {
		return txResult{outcome: txAbandoned, err: err, failed: -1}
	}
	defer p.guard.leave(suspect)
	r := p.transaction(ctx, jobs)
	if r.outcome != txCommitted && ctx.Err() != nil {
		// Cut short while running: by a lost delivery, or by the shutdown
		// deadline (a stall, which keeps its crash-guard record as a
		// crash would; see settler.abandon). A suspect's delivery that the
		// broker took back, unacked too long, while its handler ran alone
		// counts the same: a handler that always outlasts the broker's
		// consumer_timeout is then dead-lettered after
		// CrashGuard.MaxCrashes runs instead of being redelivered for
		// ever. Only the suspect running alone is charged, never the
		// messages whose deliveries were taken back with it, nor any
		// delivery lost with its connection.
		for _, j := range jobs {
			j.stalled = j.dctx.Err() == nil || j == suspect && j.timedOut
		}
		if suspect != nil {
			// Given back before its lock is released (leave): another
			// process may be waiting to read its record.
			p.guard.forget(suspect)
		}
		return txResult{outcome: txAbandoned, err: r.err, failed: -1}
	}
	if suspect != nil && r.outcome != txCommitted && r.outcome != txAbandoned {
		// The attempt ended here, without a crash: a run of the handler,
		// unless it was an infrastructure failure.
		p.guard.endAttempt(ctx, suspect, r)
	}
	return r
}

func (p *pipeline) transaction(ctx context.Context, jobs []*job) (r txResult) {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	claims, err := p.queueClaimsByPosition(b, jobs)
	if err != nil {
		return txResult{outcome: txInfra, err: err, failed: -1}
	}
	// A message deduplicated by its position has no row for a retry's
	// claim to find: if a COMMIT loses its reply, the transaction's id
	// tells whether it committed.
	var xid int64
	if anyByPosition(jobs) {
		b.Queue(`SELECT txid_current()`).QueryRow(func(row pgx.Row) error { return row.Scan(&xid) })
	}
	conn, err := p.acquire(ctx)
	if err != nil {
		return txResult{outcome: txInfra, err: err, failed: -1}
	}
	defer conn.Release() // after the rollback below
	step := new(dbStep)  // each step of the transaction's in turn
	sctx := p.stepOn(ctx, conn.Conn(), step)
	tx, err := p.begin(sctx, conn, b)
	committed := false
	if tx != nil {
		defer func() {
			if !committed {
				p.rollback(ctx, tx, step)
			}
		}()
	}
	res, err := p.claimed(sctx, tx, jobs, claims, err)
	p.endStep(step)
	if err != nil {
		return txResult{outcome: txInfra, err: err, failed: -1}
	}
	defer func() {
		if r.outcome == txInfra {
			r.lost = sessionLost(tx, r.err)
		}
	}()
	crashPoint("after-claim")
	if r, stop := p.runHandlers(ctx, tx, jobs, res, xid); stop {
		return r
	}
	sctx = p.stepOn(ctx, tx.Conn(), step)
	defer p.endStep(step) // before the rollback
	if r, stop := p.recordProgress(sctx, tx, jobs, res); stop {
		r.err = unanswered(sctx, p.cfg.DatabaseTimeout, r.err)
		return r
	}
	crashPoint("after-handler")
	start := time.Now()
	err = unanswered(sctx, p.cfg.DatabaseTimeout, tx.Commit(sctx))
	p.tel.since(ctx, p.tel.commitDur, start)
	p.tel.batchSize.Record(ctx, int64(len(jobs)), p.tel.baseRecord...)
	if err != nil {
		if xid != 0 && outcomeUnknown(err) && p.committedAfterAll(ctx, xid, len(jobs)) {
			return txResult{outcome: txCommitted, claims: res, failed: -1}
		}
		return p.commitFailure(ctx, tx, jobs, err)
	}
	committed = true // nothing to roll back
	crashPoint("after-commit")
	return txResult{outcome: txCommitted, claims: res, failed: -1}
}

// claimed reads the claims of jobs in tx, once begin returned beginErr,
// then checks the first positions and clears the crash-guard records of
// jobs: the transaction's first step, before any handler runs.
func (p *pipeline) claimed(ctx context.Context, tx pgx.Tx, jobs []*job, claims func(context.Context, dedup.DB) ([]dedup.Result, error), beginErr error) ([]dedup.Result, error) {
	if beginErr != nil {
		return nil, unanswered(ctx, p.cfg.DatabaseTimeout, beginErr)
	}
	res, err := claims(ctx, tx)
	if err == nil {
		err = p.checkFirstPositions(ctx, tx, jobs, res)
	}
	if err == nil {
		err = p.guard.clearIn(ctx, tx, jobs)
	}
	return res, unanswered(ctx, p.cfg.DatabaseTimeout, err)
}

// rollback rolls tx back, unless it ended, as step, the transaction's
// last. It outlives a lost delivery, never the shutdown deadline nor a
// connection found stranded (stepOn): a database that stopped answering
// then loses the connection, and with it the transaction.
func (p *pipeline) rollback(ctx context.Context, tx pgx.Tx, step *dbStep) {
	ctx, cancel := p.detached(ctx)
	defer cancel()
	ctx = p.stepOn(ctx, tx.Conn(), step)
	defer p.endStep(step)
	_ = tx.Rollback(ctx)
}

// queueClaims queues the claim of every job on b, after its BEGIN, and
// returns the function that reads their results. A run of one uses the
// single-row claim, which is cheaper than the batch statement.
func (p *pipeline) queueClaims(b *pgx.Batch, jobs []*job) (func(context.Context, dedup.DB) ([]dedup.Result, error), error) {
	if len(jobs) == 1 {
		pending := p.cfg.Store.QueueClaim(b, jobs[0].claim(p.cfg.Name))
		return func(ctx context.Context, tx dedup.DB) ([]dedup.Result, error) {
			r, err := pending.Result(ctx, tx)
			return []dedup.Result{r}, err
		}, nil
	}
	claims := make([]dedup.Claim, len(jobs))
	for i, j := range jobs {
		claims[i] = j.claim(p.cfg.Name)
	}
	pending, err := p.cfg.Store.QueueClaimBatch(b, claims)
	if err != nil {
		return nil, err
	}
	return pending.Results, nil
}

// begin sends b, which begins a transaction, on conn, and returns the
// transaction once b's results are read. The transaction is returned, to
// be rolled back, even when err is not nil.
func (p *pipeline) begin(ctx context.Context, conn *pgxpool.Conn, b *pgx.Batch) (pgx.Tx, error) {
	br := conn.SendBatch(ctx, b)
	return br.Tx(), br.Close()
}

// runHandlers runs the handlers of the claimed jobs in tx: one call of the
// BatchHandler, or each Handler in turn, then sends what they queued. It
// reports whether the transaction must stop short of its commit, and why.
// xid is the transaction's id, when it was read (see transaction).
func (p *pipeline) runHandlers(ctx context.Context, tx pgx.Tx, jobs []*job, res []dedup.Result, xid int64) (txResult, bool) {
	if p.batchCall != nil && len(jobs) > 1 {
		return p.runBatchHandler(ctx, tx, jobs, res, xid)
	}
	qtx := newQueueTx(tx)
	defer qtx.retire() // a handler that kept tx gets ErrTxClosed
	qtx.xid, qtx.xidStatus = xid, p.askXIDStatus
	for i, j := range jobs {
		if i > 0 && p.stopping.Load() {
			// Shutting down: roll back rather than wait for the whole
			// run. (Committing the handled part would commit the claims
			// of the unhandled part too.)
			return txResult{outcome: txAbandoned, failed: -1}, true
		}
		if res[i].Outcome != dedup.Claimed || j.call == nil {
			continue
		}
		if i == len(jobs)/2 && len(jobs) > 1 {
			crashPoint("mid-batch")
		}
		qtx.owner = i
		attempt, again := j.runs+1, j.ran
		j.ran = true
		var err error
		if len(p.cfg.Hooks.Middleware) == 0 {
			// No closure that escapes: nothing to allocate per message.
			err = p.callHandler(j.ctx, qtx, &j.watch, p.handlerName(), j.m, j.idt.id, 1, func(hctx context.Context) error { return j.call.run(hctx, qtx, qtx, attempt, again) })
		} else {
			call := p.cfg.Hooks.wrap(j, attempt, func(ctx context.Context, tx pgx.Tx) error {
				// tx is qtx, or a middleware's own tx around it.
				return j.call.run(ctx, tx, qtx, attempt, again)
			})
			err = p.callHandler(j.ctx, qtx, &j.watch, p.handlerName(), j.m, j.idt.id, 1, func(hctx context.Context) error { return call(hctx, qtx) })
		}
		j.timedOut = errors.Is(context.Cause(j.dctx), ErrDeliveryTimedOut)
		qtx.checkEnd(ctx)
		if f := qtx.failed; f != nil {
			// A statement queued by this or an earlier event failed.
			return p.handlerFailure(ctx, tx, jobs, f.owner, f.err), true
		}
		broken := qtx.broken()
		if errors.Is(broken, pgx.ErrTxClosed) {
			return p.endedByHandler(ctx, tx, qtx, jobs, res, i, xid), true
		}
		if err == nil {
			// It may have left the transaction unable to go on: aborted
			// by a statement whose error it swallowed, or its connection
			// busy with rows it never closed. That is its failure, not
			// that of whatever is sent on tx next.
			err = brokenTxError(broken)
		}
		if err != nil {
			return p.handlerFailure(ctx, tx, jobs, i, err), true
		}
	}
	if f := p.flushQueued(ctx, qtx); f != nil {
		return p.handlerFailure(ctx, tx, jobs, f.owner, f.err), true
	}
	if qtx.closedBy != nil {
		// A statement queued by one of them ended the transaction.
		return p.endedByHandler(ctx, tx, qtx, jobs, res, *qtx.closedBy, xid), true
	}
	return p.brokenFailure(ctx, tx, qtx, jobs)
}

// endedByHandler is the result when a handler's statement ended the
// transaction (COMMIT, END, ROLLBACK, ABORT, sent through tx or queued):
// the statement's job fails (qtx.closedBy, else the job at i, whose
// handler ran last), whatever its handler returned. A COMMIT made the
// claims of the messages after it durable before their handlers ran, or
// before their statements were sent; they are taken back, so that those
// messages run again instead of being skipped as duplicates. (The messages
// before it, whose effects that COMMIT made durable with their claims, are
// duplicates when they run again, or, deduplicated by their position,
// settled as committed.)
func (p *pipeline) endedByHandler(ctx context.Context, tx pgx.Tx, qtx *queueTx, jobs []*job, res []dedup.Result, i int, xid int64) txResult {
	if qtx.closedBy != nil {
		i = *qtx.closedBy
	}
	done, err := p.handlerEnded(ctx, tx, jobs, res, i, xid, qtx.rolledBack)
	if err != nil {
		return txResult{outcome: txAbandoned, err: err, failed: -1}
	}
	r := p.handlerFailure(ctx, tx, jobs, i, brokenTxError(pgx.ErrTxClosed))
	if r.outcome == txFailed && done {
		r.doneBefore, r.claims = true, res
	}
	return r
}

// xidStatus asks the status of transaction xid (txid_status) on conn, or
// on a connection of the pool when conn is nil, once, as a step of the
// consumer's own (stepAlone, onConn): nil when xid is too old to tell.
func (p *pipeline) xidStatus(ctx context.Context, conn *pgx.Conn, xid int64) (*string, error) {
	var status *string
	ask := func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, `SELECT txid_status($1)`, xid).Scan(&status)
	}
	if conn != nil {
		return status, p.stepAlone(ctx, conn, ask)
	}
	err := p.onConn(ctx, func(ctx context.Context, conn *pgxpool.Conn) error { return ask(ctx, conn.Conn()) })
	return status, err
}

// handlerEnded is the aftermath of a transaction that the handler of
// jobs[i] ended with a statement of its own (rolledBack: a ROLLBACK, which
// left nothing committed): it takes back the claims of the jobs after it
// (releaseClaims), and reports whether the jobs before it are known to be
// committed (doneByHandlerCommit, which records their progress). It
// returns an error when the consumer stops first, or when the source's
// partition was taken over (dedup.ErrFenced).
func (p *pipeline) handlerEnded(ctx context.Context, tx pgx.Tx, jobs []*job, res []dedup.Result, i int, xid int64, rolledBack bool) (bool, error) {
	if rolledBack {
		// No claim of the batch's is left to take back: a claim of the
		// same id found now is another transaction's.
		return false, nil
	}
	if err := p.releaseClaims(ctx, tx, jobs[i+1:], res[i+1:]); err != nil {
		return false, err
	}
	return p.doneByHandlerCommit(ctx, tx, jobs[:i], res[:i], xid)
}

// doneByHandlerCommit reports whether done, jobs whose effects a handler's
// statement (sent through tx, whose connection it left out of any
// transaction) made durable if it committed their transaction, are known
// to be committed: when some are deduplicated by their position, whose
// claims have no row to find when they run again, and the transaction's
// id (xid) committed. Their progress, which the consumer writes just
// before its own COMMIT, is then recorded in a transaction of its own. It
// returns an error when the consumer stops first, or when the source's
// partition was taken over (dedup.ErrFenced).
func (p *pipeline) doneByHandlerCommit(ctx context.Context, tx pgx.Tx, done []*job, res []dedup.Result, xid int64) (bool, error) {
	if xid == 0 || len(done) == 0 || !anyByPosition(done) {
		return false, nil
	}
	ctx, cancel := p.detached(ctx)
	defer cancel()
	conn := idleConn(tx)
	var status *string
	err := errNoStatus
	if conn != nil {
		status, err = p.xidStatus(ctx, conn, xid)
	}
	committed := err == nil && status != nil && *status == "committed"
	if err != nil {
		committed = p.committedAfterAll(ctx, xid, len(done))
	}
	if !committed {
		return false, nil
	}
	rec, ok := p.src.(ProgressRecorder)
	if !ok {
		return true, nil
	}
	dvs := make([]Delivery, 0, len(done))
	for k, j := range done {
		if res[k].Outcome == dedup.Conflict && p.cfg.Identify.OnConflict == DeadLetterConflicts {
			continue // done once dead-lettered
		}
		dvs = append(dvs, j.d)
	}
	record := func(ctx context.Context, db interface {
		Begin(context.Context) (pgx.Tx, error)
	}) error {
		return pgx.BeginFunc(ctx, db, func(ptx pgx.Tx) error {
			return p.watchedSourceCall(new(userCall), "Source.RecordProgress", nil, "", len(dvs), func() error { return rec.RecordProgress(ctx, ptx, dvs) })
		})
	}
	if conn = idleConn(tx); conn != nil {
		err := p.stepAlone(ctx, conn, func(ctx context.Context, conn *pgx.Conn) error { return record(ctx, conn) })
		if err == nil || errors.Is(err, dedup.ErrFenced) {
			return err == nil, err
		}
	}
	var fenced error
	err = p.infra(ctx, "recording the progress of messages a handler's own COMMIT committed", Retry{Messages: len(done)}, func() error {
		err := p.onConn(ctx, func(ctx context.Context, conn *pgxpool.Conn) error { return record(ctx, conn) })
		if errors.Is(err, dedup.ErrFenced) {
			fenced = err
			return nil
		}
		return err
	})
	if fenced != nil {
		return false, fenced
	}
	return err == nil, err
}

// idleConn returns tx's connection if it is open and idle, out of any
// transaction (a handler's statement ended tx); nil otherwise.
func idleConn(tx pgx.Tx) *pgx.Conn {
	c := tx.Conn()
	if c == nil || c.IsClosed() || c.PgConn().IsBusy() || c.PgConn().TxStatus() != 'I' {
		return nil
	}
	return c
}

// releaseClaims deletes the claim rows of jobs (with their claim results
// res) that tx made durable before their handlers ran: tx is a transaction
// a handler ended with a COMMIT of its own. The DELETE is sent outside any
// transaction on tx's connection, now idle, or, if that fails, on a
// connection of the pool, retried until the consumer stops (the error
// then). It outlives a lost delivery, as the claims do. Jobs deduplicated
// by their position have no claim row.
func (p *pipeline) releaseClaims(ctx context.Context, tx pgx.Tx, jobs []*job, res []dedup.Result) error {
	var ids []string
	for k, j := range jobs {
		if res[k].Outcome == dedup.Claimed && j.call != nil && !deduplicatedByPosition(j) {
			ids = append(ids, j.idt.id)
		}
	}
	if len(ids) == 0 {
		return nil
	}
	ctx, cancel := p.detached(ctx)
	defer cancel()
	sql := `DELETE FROM ` + p.cfg.Store.ProcessedTable() + ` WHERE consumer = $1 AND event_id = ANY($2::text[])`
	if c := idleConn(tx); c != nil {
		err := p.stepAlone(ctx, c, func(ctx context.Context, c *pgx.Conn) error {
			_, err := c.Exec(ctx, sql, p.cfg.Name, ids)
			return err
		})
		if err == nil {
			return nil
		}
	}
	return p.infra(ctx, "taking back the claims of messages whose handlers had not run", Retry{Messages: len(ids)}, func() error {
		return p.onConn(ctx, func(ctx context.Context, conn *pgxpool.Conn) error {
			_, err := conn.Exec(ctx, sql, p.cfg.Name, ids)
			return err
		})
	})
}

// brokenFailure is the result when the handlers left tx unable to commit
// (see queueTx.broken), as its COMMIT would have failed: checked before
// anything else is sent on tx (a source's progress, the COMMIT), whose
// error would not say the handler's doing.
func (p *pipeline) brokenFailure(ctx context.Context, tx pgx.Tx, qtx *queueTx, jobs []*job) (txResult, bool) {
	if err := qtx.broken(); err != nil {
		return p.commitFailure(ctx, tx, jobs, err), true
	}
	return txResult{}, false
}

// runBatchHandler calls the BatchHandler once with the claimed jobs. xid
// is the transaction's id, when it was read (see transaction).
func (p *pipeline) runBatchHandler(ctx context.Context, tx pgx.Tx, jobs []*job, res []dedup.Result, xid int64) (txResult, bool) {
	claimed := make([]*job, 0, len(jobs))
	for i, j := range jobs {
		if res[i].Outcome == dedup.Claimed {
			claimed = append(claimed, j)
		}
	}
	if len(claimed) == 0 {
		return txResult{}, false
	}
	qtx := newQueueTx(tx)
	defer qtx.retire() // a handler that kept tx gets ErrTxClosed
	qtx.owner = -1
	qtx.xid, qtx.xidStatus = xid, p.askXIDStatus
	var m *Message
	var id string
	if len(claimed) == 1 {
		m, id = claimed[0].m, claimed[0].idt.id
	}
	err := p.callHandler(ctx, qtx, new(userCall), batchHandlerCall, m, id, len(claimed), func(hctx context.Context) error {
		return p.batchCall(hctx, qtx, claimed)
	})
	qtx.checkEnd(ctx)
	if err == nil {
		if f := p.flushQueued(ctx, qtx); f != nil {
			err = f.err
		}
	}
	if r, ended := p.batchCommittedByHandler(ctx, tx, jobs, res, xid); ended {
		return r, true
	}
	if err != nil {
		// A BatchHandler's error names no event.
		return p.handlerFailure(ctx, tx, jobs, -1, err), true
	}
	return p.brokenFailure(ctx, tx, qtx, jobs)
}

// batchCommittedByHandler is the result, and true, when the BatchHandler
// ended the batch's transaction with a COMMIT of its own (its connection is
// out of any transaction) and that committed every job's claim and the
// effects written before it, what it wrote after going through at once:
// the jobs are then done, whatever it returned. That is known for a batch
// with jobs deduplicated by their position, whose transaction's id was
// read (xid), and must be: they have no claim row, so run again (the batch
// halved for the failure) they would all be handled again, their effects
// doubled. Their progress is recorded in a transaction of its own. The
// jobs of any other batch are found as duplicates when they run again.
func (p *pipeline) batchCommittedByHandler(ctx context.Context, tx pgx.Tx, jobs []*job, res []dedup.Result, xid int64) (txResult, bool) {
	if xid == 0 || idleConn(tx) == nil {
		return txResult{}, false
	}
	done, err := p.doneByHandlerCommit(ctx, tx, jobs, res, xid)
	switch {
	case err != nil:
		return txResult{outcome: txAbandoned, err: err, failed: -1}, true
	case done:
		return txResult{outcome: txCommitted, claims: res, failed: -1}, true
	}
	return txResult{}, false
}

// callHandler runs a handler under Config.HandlerTimeout (unless it is
// NoHandlerTimeout), which bounds the handler alone: not the wait for a
// connection, the claim, the queued statements or the commit. A panic becomes a PanicError; a handler that
// outlived its timeout and returned an error fails with an error that says
// so, and so does one that returned nil after the timeout cut one of its
// statements: pgx then closed tx's connection, and the transaction is lost
// to the handler's timeout, not to the database. (One that returned nil
// with no statement cut left tx whole: its run stands.) The same holds for a deadline the handler
// put on one of its own statements, or a context of its own it canceled
// under one (sawCut), whatever it made of that error.
//
// The call is in the watchdog's list as c (name, and m and eventID for a
// call on one message, else messages), to be logged if it ignores its
// context's end (handlerWatchAfter).
func (p *pipeline) callHandler(ctx context.Context, tx *queueTx, c *userCall, name string, m *Message, eventID string, messages int, run func(context.Context) error) (err error) {
	hctx := ctx
	switch {
	case p.cfg.HandlerTimeout > 0:
		var cancel context.CancelFunc
		hctx, cancel = context.WithTimeout(ctx, p.cfg.HandlerTimeout)
		defer cancel()
		var cut context.CancelFunc
		if p.asksAfterSessions() {
			cut = cancel // stranded.go
		}
		p.watch.beginHandler(c, name, m, eventID, messages, p.handlerWatchAfter, tx.Conn().PgConn().PID(), cut, tx.began)
		defer p.watch.end(c)
	case p.watchesUnboundedHandlers():
		// Under NoHandlerTimeout nothing cuts the call at a deadline, but
		// a stranded session is cut all the same (stranded.go), and a
		// statement_timeout's cancel of a lock wait is told from the
		// statement's own (lockwait.go). Never logged as overdue.
		var cancel context.CancelFunc
		hctx, cancel = context.WithCancel(ctx)
		defer cancel()
		var cut context.CancelFunc
		if p.asksAfterSessions() {
			cut = cancel
		}
		p.watch.beginHandler(c, name, m, eventID, messages, neverOverdue, tx.Conn().PgConn().PID(), cut, tx.began)
		defer p.watch.end(c)
	}
	tx.handlerDeadline, _ = hctx.Deadline()
	tx.handlerDone, tx.canceledByHandler = hctx.Done(), false
	start := time.Now()
	defer func() {
		if r := recover(); r != nil {
			err = &PanicError{Value: r, Stack: string(debug.Stack())}
		}
		err = readableError(err)
		p.tel.since(ctx, p.tel.handlerDur, start)
		switch {
		case ctx.Err() != nil:
		case p.watch.wasStranded(c):
			if err == nil {
				err = hctx.Err()
			}
			err = &strandedError{waited: time.Since(start), err: err}
		case errors.Is(hctx.Err(), context.DeadlineExceeded):
			switch {
			case err != nil:
				err = &timeoutError{limit: p.cfg.HandlerTimeout, err: err, lockedBy: p.cutInLockWait(c, tx, err)}
			case tx.Conn().IsClosed():
				err = &timeoutError{limit: p.cfg.HandlerTimeout, err: hctx.Err(), lockedBy: p.cutInLockWait(c, tx, nil)}
			}
		case !isPanic(err) && (tx.cutByOwnDeadline() || tx.canceledByHandler) && tx.Conn().IsClosed():
			if err == nil {
				err = errors.New("the handler returned nil")
			}
			err = &ownDeadlineError{err: err, canceled: !tx.cutByOwnDeadline()}
		case !isPanic(err) && sqlState(err) == queryCanceled:
			if by := p.watch.lockedBy(c); len(by) > 0 {
				err = &canceledInLockWaitError{err: err, lockedBy: by}
			}
		}
	}()
	return run(hctx)
}

// readableError returns err, or, when its Error method panics (a user's
// error type formatting a nil field), or an Unwrap, Is or As method of an
// error in its tree does, the handler's panic in its place: the consumer
// reads the message of the handler's error, and unwraps it (errors.As,
// errors.Is), outside the handler's recover, to classify, log and
// dead-letter it, and such an error crashed the process there, on every
// delivery of the message. errors.Is and errors.As with a target no error
// matches call each of those methods in the tree once.
func readableError(err error) (readable error) {
	if err == nil {
		return nil
	}
	method := "Error"
	defer func() {
		if r := recover(); r != nil {
			readable = &PanicError{Value: fmt.Sprintf("the %s method of the handler's error (%T) panicked: %v", method, err, r), Stack: string(debug.Stack())}
		}
	}()
	_ = err.Error()
	method = "Unwrap or Is"
	_ = errors.Is(err, unmatchedError{})
	method = "Unwrap or As"
	var probe unmatchedError
	_ = errors.As(err, &probe)
	return err
}

// unmatchedError is an error no handler's error is, nor wraps: the target
// with which readableError walks an error's tree.
type unmatchedError struct{}

func (unmatchedError) Error() string { return "unmatched" }

// queryCanceled is the SQLSTATE of a statement the server canceled: past
// statement_timeout, or by pg_cancel_backend.
const queryCanceled = "57014"

// canceledInLockWaitError is a handler's failure after the server canceled
// its statement (statement_timeout) while, as the watchdog last saw it, the
// statement waited for the locks of the server processes lockedBy: another
// session's doing, as a lock_timeout's 55P03 is.
type canceledInLockWaitError struct {
	err      error
	lockedBy []uint32
}

func (e *canceledInLockWaitError) Error() string {
	return fmt.Sprintf("the server canceled the handler's statement%s: %v", lockWaitNote(e.lockedBy), e.err)
}
func (e *canceledInLockWaitError) Unwrap() error { return e.err }

// handlerName names the handler's calls in the watchdog's log.
func (p *pipeline) handlerName() string {
	if p.batchCall != nil {
		return batchHandlerCall
	}
	return handlerCall
}

// timeoutError is a handler's failure to finish within HandlerTimeout.
// lockedBy, when set, are the server processes whose locks its statement
// waited for when it was cut (cutInLockWait).
type timeoutError struct {
	limit    time.Duration
	err      error
	lockedBy []uint32
}

func (e *timeoutError) Error() string {
	return fmt.Sprintf("handler exceeded HandlerTimeout (%s)%s: %v", e.limit, lockWaitNote(e.lockedBy), e.err)
}
func (e *timeoutError) Unwrap() error { return e.err }

// ownDeadlineError is a handler's failure after a deadline it put on one of
// its own statements cut that statement, or a context of its own was
// canceled under it (canceled), closing the transaction's connection: the
// handler's doing, whatever error it returned.
type ownDeadlineError struct {
	err      error
	canceled bool
}

func (e *ownDeadlineError) Error() string {
	if e.canceled {
		return fmt.Sprintf("a context the handler canceled under one of its statements closed the transaction's connection: %v", e.err)
	}
	return fmt.Sprintf("a deadline the handler put on one of its statements passed, closing the transaction's connection: %v", e.err)
}
func (e *ownDeadlineError) Unwrap() error { return e.err }

// isPanic reports whether err is a handler's panic.
func isPanic(err error) bool {
	var panicked *PanicError
	return errors.As(err, &panicked)
}

// handlerFailure is the result when the handler of jobs[i] failed with err
// (its own error, or that of a statement it queued); i < 0 when the
// failure names no job.
func (p *pipeline) handlerFailure(ctx context.Context, tx pgx.Tx, jobs []*job, i int, err error) txResult {
	if ctx.Err() != nil {
		return txResult{outcome: txAbandoned, err: err, failed: -1}
	}
	class := p.classify(ctx, tx, err)
	switch {
	case class == ClassInfrastructure && len(jobs) > 1 && sqlState(err) == outOfMemory:
		// What the run's transaction holds until it ends (the locks of
		// every handler, in a lock table the whole server shares) may
		// not fit together, though each message's fits alone: tried as
		// it is, the run would fail the same way for ever. Halved, it
		// finds runs that fit, charging no message.
		return txResult{outcome: txUnpinned, err: err, failed: -1, class: class}
	case class == ClassInfrastructure:
		p.dropStalePlans(ctx, tx, err)
		return txResult{outcome: txInfra, err: err, failed: -1, class: class}
	case i < 0 && len(jobs) == 1:
		i = 0
	case i < 0, len(jobs) > 1 && transactionTimeRanOut(err):
		// The server ended a transaction for time it spent across the
		// run: the statement that met the end is not its cause, as the
		// time may have been any earlier handler's. Halved, the run finds
		// the handler that idles alone, or runs that fit the limit.
		return txResult{outcome: txUnpinned, err: err, failed: -1, class: class}
	}
	return txResult{outcome: txFailed, failed: i, err: err, class: class}
}

// outOfMemory is the SQLSTATE of "out of memory" and of "out of shared
// memory": among others, a lock table (max_locks_per_transaction ×
// max_connections) or a predicate lock table full.
const outOfMemory = "53200"

// lockTableFull reports whether err is PostgreSQL's lock table, or its
// predicate lock table, full: a 53200 whose hint names the setting to
// raise. The hint's text follows the server's lc_messages, the setting's
// name does not. A 53200 without it is the server out of memory, which
// no message causes alone.
func lockTableFull(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == outOfMemory &&
		(strings.Contains(pgErr.Hint, "max_locks_per_transaction") || strings.Contains(pgErr.Hint, "max_pred_locks_per_transaction"))
}

// dropStalePlans closes tx's connection when err is a cached plan that a
// schema change made stale (staleCachedPlan), so that the pool destroys it
// when the transaction releases it and the retry runs on a connection that
// prepares its statements anew. pgx forgets a cached statement that failed
// by itself, but keeps one the handler prepared by name (tx.Prepare),
// which would then fail every retry that meets this connection. Each
// connection that holds the stale plan is closed once, when its turn
// comes; the pool's other connections, which other code may share, are
// left alone.
func (p *pipeline) dropStalePlans(ctx context.Context, tx pgx.Tx, err error) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || !staleCachedPlan(pgErr) {
		return
	}
	ctx, cancel := p.detached(ctx)
	defer cancel()
	_ = tx.Conn().Close(ctx)
}

// transactionTimeRanOut reports whether err is the server ending a
// transaction for the time it took as a whole, not for the statement that
// met the end: idle_in_transaction_session_timeout (25P03: a session idle
// in its transaction too long, between any two statements) or PostgreSQL
// 17's transaction_timeout (25P04: a transaction open too long).
func transactionTimeRanOut(err error) bool {
	switch sqlState(err) {
	case "25P03", "25P04":
		return true
	}
	return false
}

// brokenTxError is the failure of a handler that returned nil and left its
// transaction as brokenByHandler found it (err); nil for a nil err.
func brokenTxError(err error) error {
	switch {
	case errors.Is(err, errLeftBusy):
		return err
	case errors.Is(err, ErrTxOwnedByConsumer):
		return Permanent(errors.New("the handler called Commit or Rollback on the consumer's transaction " +
			"(refused: the consumer commits after the handler returns; return an error to roll back)"))
	case errors.Is(err, pgx.ErrTxCommitRollback):
		return errors.New("the handler returned nil, but a statement it sent failed and aborted the transaction")
	case errors.Is(err, pgx.ErrTxClosed):
		return Permanent(errors.New("the handler ended the consumer's transaction with a statement of its own (COMMIT, ROLLBACK)"))
	}
	return nil
}

// brokenByHandler returns the error a COMMIT of tx would end with when a
// handler left tx unable to commit, as tx's connection shows it:
// pgx.ErrTxCommitRollback when a statement failed and the handler
// swallowed its error (the transaction is aborted), pgx.ErrTxClosed when
// it ended the transaction with a statement of its own (COMMIT, ROLLBACK
// sent through Exec; Tx.Commit and Tx.Rollback are refused);
// errLeftBusy when it returned with a statement's results still being read
// on the connection (rows or batch results it never closed), on which no
// other statement, the COMMIT included, can be sent; nil otherwise, also
// when the connection is lost (a database failure, which the next
// statement reports).
func brokenByHandler(tx pgx.Tx) error {
	c := tx.Conn()
	if c == nil || c.IsClosed() {
		return nil
	}
	if c.PgConn().IsBusy() {
		return errLeftBusy
	}
	switch c.PgConn().TxStatus() {
	case 'E':
		return pgx.ErrTxCommitRollback
	case 'I':
		return pgx.ErrTxClosed
	}
	return nil
}

// errLeftBusy is the failure of a handler that returned with a statement's
// results still being read on its transaction's connection.
var errLeftBusy = errors.New("the handler returned with the results of a statement not read to the end " +
	"(pgx.Rows or BatchResults not closed): its transaction's connection can send nothing else")

// commitFailure is the result of a failed COMMIT. An error whose class
// says retrying can help (a lost connection, an outcome unknown) is
// infrastructure: the retry finds the claims committed, as duplicates, if
// the commit did happen. A deterministic error (a deferred constraint) is
// the run's failure, like a handler's.
func (p *pipeline) commitFailure(ctx context.Context, tx pgx.Tx, jobs []*job, err error) txResult {
	switch {
	case errors.Is(err, pgx.ErrTxCommitRollback):
		err = errors.New("the transaction was aborted by a failed statement whose error the handler did not return")
	case errors.Is(err, pgx.ErrTxClosed), errors.Is(err, ErrTxOwnedByConsumer):
		err = brokenTxError(err)
	case errors.Is(err, errLeftBusy):
		// The handler's doing, not the database's.
	case sqlState(err) == "":
		return txResult{outcome: txInfra, err: fmt.Errorf("commit: %w", err), failed: -1}
	default:
		err = fmt.Errorf("commit: %w", err)
	}
	return p.handlerFailure(ctx, tx, jobs, -1, err)
}

// sessionLost reports whether err, the infrastructure failure of tx after
// its claims, lost tx's connection with its session: its server process
// ended (57P01: an administrator's or its own pg_terminate_backend; 57P02:
// the server restarting after another process crashed), the connection
// closed under it without a word from the server (the process killed, the
// server gone), or the watchdog cut it, its session gone or unanswered.
// A lock, a serialization failure, a read-only server or a stale plan
// leave the session as it was, and so does the cut of a statement that
// waited for another session's lock.
func sessionLost(tx pgx.Tx, err error) bool {
	switch {
	case isStranded(err), errors.As(err, new(*unansweredError)):
		return true
	case errors.As(err, new(*canceledInLockWaitError)), errors.As(err, new(*timeoutError)):
		return false
	}
	switch code := sqlState(err); {
	case code == "57P01", code == "57P02", strings.HasPrefix(code, "08"):
		return true
	case code != "":
		return false
	}
	return tx.Conn().IsClosed()
}

// outcomeUnknown reports whether a failed COMMIT may have committed: it
// failed without a word from the server (a lost connection).
func outcomeUnknown(err error) bool {
	return sqlState(err) == "" && !errors.Is(err, pgx.ErrTxCommitRollback) && !errors.Is(err, pgx.ErrTxClosed)
}

// committedAfterAll reports whether transaction xid, whose COMMIT lost its
// reply, did commit; false when it did not, or when the consumer stopped
// (or ctx ended) before the server could tell. messages wait for it.
func (p *pipeline) committedAfterAll(ctx context.Context, xid int64, messages int) bool {
	var committed bool
	err := p.infra(ctx, "learning whether a commit whose reply was lost committed", Retry{Messages: messages}, func() error {
		var status *string
		err := p.onConn(ctx, func(ctx context.Context, conn *pgxpool.Conn) error {
			return conn.QueryRow(ctx, `SELECT txid_status($1)`, xid).Scan(&status)
		})
		if err != nil {
			return err
		}
		if status != nil && *status == "in progress" {
			// Its server process has not yet seen the connection go.
			return errors.New("the transaction is still in progress")
		}
		committed = status != nil && *status == "committed"
		return nil
	})
	return err == nil && committed
}

// classify returns err's class: Classify's, or infrastructure when the
// transaction's connection died under the handler, then as
// Config.Retry.Classify says.
func (p *pipeline) classify(ctx context.Context, tx pgx.Tx, err error) (class ErrorClass) {
	class = Classify(err)
	var timeout *timeoutError
	var own *ownDeadlineError
	switch {
	case isStranded(err):
		// The transaction's server process is gone: no answer was coming.
		class = ClassInfrastructure
	case errors.As(err, new(*canceledInLockWaitError)):
		// statement_timeout cut a wait for another session's lock.
		class = ClassInfrastructure
	case errors.As(err, &timeout) && len(timeout.lockedBy) > 0:
		// Cut while another session's lock held its statement: that
		// session's doing (a migration rewriting the table, a long
		// transaction), not the message's.
		class = ClassInfrastructure
	case errors.As(err, &timeout):
		// The handler's own deadline, whatever it broke on its way out.
		class = ClassRetry
	case errors.As(err, &own) && class != ClassPermanent:
		// A deadline of the handler's on one of its statements: the
		// closed connection is the handler's doing.
		class = ClassRetry
	case isPanic(err):
		// A bug in the handler, whatever state it left its connection
		// in.
	case class == ClassRetry && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) &&
		sqlState(err) == "" && tx.Conn().IsClosed():
		// The connection died under the handler.
		class = ClassInfrastructure
	}
	if p.cfg.Retry.Classify == nil {
		return class
	}
	def := class
	defer func() {
		if r := recover(); r != nil {
			p.cfg.Telemetry.Logger.ErrorContext(ctx, "once: Config.Retry.Classify panicked; using the default class", "consumer", p.cfg.Name,
				"panic", r, "class", def.String())
			class = def
		}
	}()
	switch c := p.cfg.Retry.Classify(err, def); c {
	case ClassInfrastructure, ClassRetry, ClassPermanent:
		return c
	}
	return def
}
