package consumer

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// Queue queues a statement to run in the event's transaction after the
// handler returns, instead of sending it at once: in a batch, the queued
// statements of every handler reach PostgreSQL together, in one round trip
// before the commit, where tx.Exec costs a round trip per statement. It
// returns pgx's QueuedQuery, so a handler that needs a statement's outcome
// attaches a callback (Exec, Query or QueryRow) that runs when the result
// arrives; a callback's error counts as the handler's:
//
//	ev.Queue(`UPDATE orders SET status = 'paid' WHERE id = $1`, ev.Payload.OrderID).
//		Exec(func(ct pgconn.CommandTag) error {
//			if ct.RowsAffected() == 0 {
//				return consumer.Permanent(errors.New("no such order"))
//			}
//			return nil
//		})
//
// Statements run in the order they were queued, and before any statement
// sent through the handlers' tx (Exec, Query, QueryRow, SendBatch,
// CopyFrom, Prepare, Begin, and through a savepoint Begin returned; not
// through tx.Conn() or LargeObjects), so
// what a handler reads sees what earlier events of the batch queued.
//
// If a queued statement or its callback fails, the failure is the queuing
// event's, exactly as if its handler had returned the error: the batch
// rolls back, and the event meets the retry policy alone (a database
// failure is retried as infrastructure, like any failed statement). A
// statement the server cannot even prepare (a typo, a missing table) fails
// before any result names its event: the batch is then halved until that
// event is alone. So is a statement cut by the context of the later
// handler's statement it was sent ahead of (that handler's HandlerTimeout,
// or a deadline of its own), which does not bound it when its event runs
// alone. A handler must not rely on a queued statement having run
// before it returns. A queued statement that ends the transaction (COMMIT,
// END, ROLLBACK, ABORT) fails the event that queued it for good, as one
// sent through tx does (see Handler); what was queued after it is not
// sent: the events after it in the batch run again.
//
// Queue may be called only while the event's handler runs, from the
// handler's goroutine (like tx itself); it panics on an Event that the
// consumer did not deliver or whose handler returned. To run a handler on
// an Event built by hand (in a test), use Call. With a BatchHandler,
// a failure of any queued statement fails the whole batch.
func (ev Event[T]) Queue(sql string, args ...any) *pgx.QueuedQuery {
	return ev.queue.add(sql, args)
}

// eventQueue is a handler's access to its transaction's write queue, valid
// while the handler runs.
type eventQueue struct {
	t      *queueTx
	owner  int
	closed bool
}

// openQueue returns the queue a handler called with tx may use, or nil if
// tx is not the consumer's.
func openQueue(tx pgx.Tx) *eventQueue {
	t, ok := tx.(*queueTx)
	if !ok {
		return nil
	}
	return &eventQueue{t: t, owner: t.owner}
}

func (q *eventQueue) close() {
	if q != nil {
		q.closed = true
	}
}

func (q *eventQueue) add(sql string, args []any) *pgx.QueuedQuery {
	switch {
	case q == nil:
		panic("consumer: Event.Queue on an event the consumer did not deliver (run the handler with consumer.Call)")
	case q.closed:
		panic("consumer: Event.Queue after the event's handler returned")
	}
	q.t.owners = append(q.t.owners, q.owner)
	return q.t.pending.Queue(sql, args...)
}

// queueTx is the transaction handlers get: a pgx.Tx that first sends what
// handlers queued (Event.Queue) whenever a statement goes through it.
type queueTx struct {
	checkedTx
	pending pgx.Batch
	// owners[i] is the job index of pending's i-th query.
	owners []int
	// owner is the index of the job whose handler runs now; -1 for a
	// BatchHandler.
	owner int
	// failed is the first queued statement that failed, once one did.
	failed *queueFailure
	// handlerDeadline is the deadline of the handler's own context (zero
	// without Config.HandlerTimeout), and deadlines the contexts with
	// another one that statements were sent under: the handler's deadlines
	// on its own queries (see cutByOwnDeadline).
	handlerDeadline time.Time
	deadlines       []context.Context
	// handlerDone is the Done channel of the handler's own context, and
	// canceledByHandler says that a statement failed once a context of
	// the handler's, not that one, was canceled under it (see sawCut).
	handlerDone       <-chan struct{}
	canceledByHandler bool
	// ended: a handler called Commit or Rollback on this Tx, which were
	// refused (ErrTxOwnedByConsumer).
	ended bool
	// rolledBack: the last statement sent through t was a ROLLBACK (its
	// command tag says so; also ABORT, ROLLBACK TO SAVEPOINT, and a COMMIT
	// of an aborted transaction): if it ended the transaction, nothing of
	// it was committed. Once closedBy is set, it says whether the
	// transaction ended rolled back.
	rolledBack bool
	// xid is the transaction's id, once read (0 before).
	xid int64
	// xidStatus asks the status of transaction xid (txid_status) on conn,
	// or on another connection when conn is nil, as a step of the
	// consumer's own (bounded by Config.DatabaseTimeout); nil when there
	// is none to ask on.
	xidStatus func(ctx context.Context, conn *pgx.Conn, xid int64) (*string, error)
	// watch is a statement sent that may have ended the transaction, to
	// be checked (see watchEnd).
	watch *endWatch
	// closedBy is the index of the job whose statement, sent through t or
	// queued, ended the transaction; nil while it has not.
	closedBy *int
	// batchAborted: a BatchHandler's statement, sent through t or queued,
	// ended the transaction rolled back (ROLLBACK, ABORT, also AND CHAIN
	// or followed by a BEGIN), leaving none of its events' claims: nothing
	// more is sent, and the transaction is not committed. (After its
	// COMMIT, which made the claims durable, what it sends goes on.)
	batchAborted bool
	// sending is the watchdog's entry for a send of the queued statements
	// after the handlers (flushQueued).
	sending userCall
	// began is when the transaction began, as far as the handlers go.
	began time.Time
	// over is set once the handlers' part of the transaction is over
	// (retire): a handler that kept tx past its return gets
	// errTxOver, and nothing reaches the connection, which the pool may
	// have lent to another message's transaction by then.
	over atomic.Bool
}

// Commit is refused with ErrTxOwnedByConsumer, marked Permanent: the
// consumer commits the transaction after the handlers return, and a
// handler's COMMIT would commit the claims of the messages after it in a
// batch before their handlers ran. The transaction is left as it was, so
// the handler's failure rolls back its writes alone. After the handler
// returned it fails with errTxOver (see retire).
func (t *queueTx) Commit(context.Context) error {
	return t.refuseEnd()
}

// Rollback is refused like Commit: a handler rolls its writes back by
// returning an error.
func (t *queueTx) Rollback(context.Context) error {
	return t.refuseEnd()
}

// refuseEnd is the answer to a handler's Commit or Rollback.
func (t *queueTx) refuseEnd() error {
	if t.over.Load() {
		return errTxOver
	}
	t.ended = true
	return Permanent(ErrTxOwnedByConsumer)
}

// broken returns the error a COMMIT would end with when the handlers left
// the transaction unable to commit: ErrTxOwnedByConsumer when one tried to
// end it through t, pgx.ErrTxClosed when a statement of one ended it
// (closedBy; also when the connection is in a transaction again, one the
// handler opened, whose COMMIT would commit none of the claims), else
// what brokenByHandler finds on the connection.
func (t *queueTx) broken() error {
	switch {
	case t.ended:
		return ErrTxOwnedByConsumer
	case t.closedBy != nil, t.batchAborted:
		return pgx.ErrTxClosed
	}
	return brokenByHandler(t.Tx)
}

// note records ctx, the context of a statement sent through t, if it has
// a deadline of its own.
func (t *queueTx) note(ctx context.Context) {
	if d, ok := ctx.Deadline(); ok && !d.Equal(t.handlerDeadline) {
		t.deadlines = append(t.deadlines, ctx)
	}
}

// cutByOwnDeadline reports whether a deadline the handler put on one of
// its statements has passed: pgx closes a connection whose statement's
// context ends, so a closed connection is then the handler's doing, not a
// database failure.
func (t *queueTx) cutByOwnDeadline() bool {
	for _, ctx := range t.deadlines {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return true
		}
	}
	return false
}

// sawCut notes the end of a statement sent under ctx, or of reading its
// results, with err: when ctx was canceled by then, and is not the
// context the consumer gave the handler (whose end the consumer knows
// of), the handler canceled it under the statement (a group of calls
// canceled when another failed), and pgx closed the connection for it:
// the handler's doing, like a deadline of its own (cutByOwnDeadline). A
// context canceled only after its statements ended (a deferred cancel)
// leaves no mark.
func (t *queueTx) sawCut(ctx context.Context, err error) {
	if err != nil && ctx.Err() != nil && t.mayCut(ctx) {
		t.canceledByHandler = true
	}
}

// mayCut reports whether ctx is a context sawCut watches: one that can be
// canceled and is not the handler's own (nor shares its Done, as one that
// only adds values does). Results read under any other context are not
// wrapped (cutRows, cutRow, cutBatchResults): sawCut would note nothing
// of them, and the wrapper cost an allocation per statement of every
// handler passing its context on.
func (t *queueTx) mayCut(ctx context.Context) bool {
	d := ctx.Done()
	return d != nil && d != t.handlerDone
}

// queueFailure is a queued statement's failure, charged to its owner (-1:
// to no job in particular).
type queueFailure struct {
	owner int
	err   error
}

func newQueueTx(tx pgx.Tx) *queueTx {
	t := &queueTx{began: time.Now()}
	t.checkedTx = checkedTx{Tx: tx, q: t}
	return t
}

// flush sends the queued statements in one round trip and records the
// first failure. After a failure it sends nothing more: the batch is
// rolled back. A statement that may end the transaction (mayEndTx) is sent
// alone, after those before it, and watched: once it ended the
// transaction, the statements queued after it are not sent (they would
// run outside any transaction, committed at once), and it is charged to
// the job that queued it (closedBy). After a BatchHandler's ROLLBACK
// nothing is sent (batchAborted).
func (t *queueTx) flush(ctx context.Context) *queueFailure {
	for t.failed == nil && !t.sendsNoMore() && len(t.pending.QueuedQueries) > 0 {
		b, owners := t.pending, t.owners
		t.pending, t.owners = pgx.Batch{}, nil
		n := len(b.QueuedQueries)
		for i, qq := range b.QueuedQueries {
			if mayEndTx(qq.SQL) {
				n = max(i, 1)
				break
			}
		}
		if n < len(b.QueuedQueries) {
			// Back in front of whatever a callback queues meanwhile.
			t.pending.QueuedQueries = append(b.QueuedQueries[n:len(b.QueuedQueries):len(b.QueuedQueries)], t.pending.QueuedQueries...)
			t.owners = append(owners[n:len(owners):len(owners)], t.owners...)
			b.QueuedQueries, owners = b.QueuedQueries[:n], owners[:n]
		}
		if n == 1 {
			t.watchEnd(ctx, owners[0], b.QueuedQueries[0].SQL)
		}
		t.send(ctx, &b, owners)
		t.checkEnd(ctx)
	}
	if t.sendsNoMore() {
		t.pending, t.owners = pgx.Batch{}, nil
	}
	return t.failed
}

// sendsNoMore reports whether nothing more may be sent on the
// transaction: a handler's statement ended it (closedBy), or a
// BatchHandler's rolled it back (batchAborted).
func (t *queueTx) sendsNoMore() bool {
	return t.closedBy != nil || t.batchAborted
}

// send sends b, whose i-th statement owners[i] queued, and records the
// first failure.
func (t *queueTx) send(ctx context.Context, b *pgx.Batch, owners []int) {
	failedAt := -1
	for i, qq := range b.QueuedQueries {
		fn := qq.Fn
		qq.Fn = func(br pgx.BatchResults) (err error) {
			if fn != nil {
				// A callback is the handler's code: its panic is the
				// queuing event's failure, as a handler's panic is,
				// also when the queue is sent after the handler
				// returned (before COMMIT), outside its guard.
				func() {
					defer func() {
						if r := recover(); r != nil {
							err = &PanicError{Value: r, Stack: string(debug.Stack())}
						}
					}()
					err = fn(br)
				}()
			} else {
				_, err = br.Exec()
			}
			if err != nil && failedAt < 0 {
				failedAt = i
			}
			return err
		}
	}
	if err := t.Tx.SendBatch(ctx, b).Close(); err != nil {
		if failedAt < 0 {
			// No result was read: the send failed (a database failure), or
			// the server refused to prepare one of the statements, which
			// pgx prepares all before running any. The error names no
			// statement, so it names no owner.
			t.failed = &queueFailure{owner: -1, err: fmt.Errorf("statements queued by the handlers: %w", err)}
			return
		}
		t.failed = &queueFailure{owner: owners[failedAt],
			err: fmt.Errorf("statement queued by the handler (%.60q): %w", b.QueuedQueries[failedAt].SQL, err)}
	}
}

// settle returns the outcome of a handler that returned err: the failure
// of a statement it queued, if one failed, else err; when the handler
// succeeded, it first sends what it queued.
func (t *queueTx) settle(ctx context.Context, err error) error {
	if t.failed == nil && err == nil {
		t.flush(ctx)
	}
	if t.failed != nil {
		return t.failed.err
	}
	return err
}

// before readies t for a statement of the running handler (sql; empty for
// a batch or a copy): it refuses it once the transaction was ended by a
// statement of a handler (endedBySQL), else sends what was queued first,
// refusing it then if that ended the transaction, and watches sql if it
// may end it (watchEnd).
func (t *queueTx) before(ctx context.Context, sql string) error {
	if t.over.Load() {
		return errTxOver
	}
	if err := t.endedBySQL(ctx); err != nil {
		return err
	}
	t.note(ctx)
	t.flushBefore(ctx)
	if err := t.endedBySQL(ctx); err != nil {
		return err
	}
	t.watchEnd(ctx, t.owner, sql)
	return nil
}

// flushBefore sends what was queued ahead of a statement of the running
// handler, under that statement's context ctx: the handler's own, bound
// by its HandlerTimeout, or one it derived with a deadline or cancel of
// its own. When ctx ended while a statement an earlier handler queued ran,
// the cut is the running handler's bound, not that statement's doing
// (sent after the handlers, as it is when its event runs alone, nothing
// bounds it): the failure names no event, and the batch is halved, so
// that neither the queuing event nor the running one is charged for it.
func (t *queueTx) flushBefore(ctx context.Context) {
	earlier := t.failed != nil
	f := t.flush(ctx)
	if !earlier && f != nil && f.owner >= 0 && f.owner != t.owner && t.owner >= 0 && ctx.Err() != nil {
		f.owner = -1
		f.err = fmt.Errorf("cut by the context of the handler running when it was sent: %w", f.err)
	}
}

// checkedTx is the transaction handlers get (the consumer's, or a
// savepoint begun on it with Begin) with each statement sent through it
// checked by q (before): what was queued is sent first, and a statement
// that may end the transaction is watched. pgx's savepoint sends its
// statements on the connection itself, past the consumer's transaction, so
// a savepoint is wrapped as well: else what was queued ran after its
// statements, and its COMMIT; BEGIN went unseen. A savepoint's Commit and
// Rollback (RELEASE, ROLLBACK TO SAVEPOINT) are pgx's.
type checkedTx struct {
	pgx.Tx
	q *queueTx
}

func (c *checkedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := c.q.before(ctx, sql); err != nil {
		return pgconn.CommandTag{}, err
	}
	ct, err := c.Tx.Exec(ctx, sql, args...)
	c.q.sawCut(ctx, err)
	c.q.rolledBack = err == nil && ct.String() == "ROLLBACK"
	c.q.checkEnd(ctx)
	return ct, err
}

func (c *checkedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := c.q.before(ctx, sql); err != nil {
		return errRows{err}, err
	}
	c.q.rolledBack = false
	rows, err := c.Tx.Query(ctx, sql, args...)
	c.q.sawCut(ctx, err)
	if !c.q.mayCut(ctx) {
		return rows, err
	}
	return &cutRows{Rows: rows, q: c.q, ctx: ctx}, err
}

func (c *checkedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if err := c.q.before(ctx, sql); err != nil {
		return errRows{err}
	}
	c.q.rolledBack = false
	row := c.Tx.QueryRow(ctx, sql, args...)
	if !c.q.mayCut(ctx) {
		return row
	}
	return cutRow{row: row, q: c.q, ctx: ctx}
}

func (c *checkedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	sql := ""
	for _, qq := range b.QueuedQueries {
		if mayEndTx(qq.SQL) {
			sql = qq.SQL
			break
		}
	}
	if err := c.q.before(ctx, sql); err != nil {
		return errBatchResults{err}
	}
	c.q.rolledBack = false
	br := c.Tx.SendBatch(ctx, b)
	if !c.q.mayCut(ctx) {
		return br
	}
	return &cutBatchResults{BatchResults: br, q: c.q, ctx: ctx}
}

func (c *checkedTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if err := c.q.before(ctx, ""); err != nil {
		return 0, err
	}
	c.q.rolledBack = false
	n, err := c.Tx.CopyFrom(ctx, table, cols, src)
	c.q.sawCut(ctx, err)
	return n, err
}

func (c *checkedTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := c.q.before(ctx, ""); err != nil {
		return nil, err
	}
	c.q.rolledBack = false
	sd, err := c.Tx.Prepare(ctx, name, sql)
	c.q.sawCut(ctx, err)
	return sd, err
}

// Begin begins a savepoint, whose statements are checked as c's are.
func (c *checkedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := c.q.before(ctx, ""); err != nil {
		return nil, err
	}
	c.q.rolledBack = false
	sp, err := c.Tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &checkedTx{Tx: sp, q: c.q}, nil
}

// endedBySQL returns errTxEndedBySQL when a statement a Handler sent
// through t or queued ended the transaction (COMMIT, END, ROLLBACK, ABORT,
// also followed by a BEGIN in the same string, or AND CHAIN): its
// connection is idle, out of any transaction, or in one the handler
// opened (closedBy). Nothing more is then sent through t: a statement
// would run in a transaction of its own, committed at once, or in one that
// holds none of the claims the consumer's COMMIT is for. A BatchHandler's
// statements after a COMMIT are not refused: its events' claims are all
// made durable by it, so what it writes after it, committed at once, is
// what keeps those events' effects. After its ROLLBACK they are
// (batchAborted).
func (t *queueTx) endedBySQL(ctx context.Context) error {
	if t.owner < 0 {
		t.checkEnd(ctx)
		if t.batchAborted {
			return errTxEndedBySQL
		}
		return nil
	}
	t.checkEnd(ctx)
	if t.closedBy != nil {
		return errTxEndedBySQL
	}
	c := t.Conn()
	if c == nil || c.IsClosed() {
		return nil
	}
	if pc := c.PgConn(); !pc.IsBusy() && pc.TxStatus() == 'I' {
		return errTxEndedBySQL
	}
	return nil
}

// retire ends the handlers' use of t, once the last of them returned: a
// statement sent through t (or a savepoint of it) later fails with
// errTxOver without touching the connection. Without it the checks of
// such a statement asked the connection after its state (endedBySQL,
// watchEnd, checkEnd), refused it as a COMMIT the handler never sent,
// and sent queries inside whatever transaction the connection was lent
// to next.
func (t *queueTx) retire() { t.over.Store(true) }

// errTxOver is the error of a statement sent through a handler's tx after
// the handler returned. It wraps pgx.ErrTxClosed, which pgx returns for
// any transaction used after its end.
var errTxOver = fmt.Errorf("once: tx used after the handler returned (keep it within the handler's call): %w", pgx.ErrTxClosed)

// errTxEndedBySQL is the error of a statement sent through the consumer's
// transaction after the handler ended it with a statement of its own.
var errTxEndedBySQL = errors.New("once: refused: a statement sent by the handler (COMMIT, END, ROLLBACK, ABORT) ended the consumer's transaction; " +
	"the consumer commits after the handler returns (return an error to roll back)")

// cutRows, cutRow and cutBatchResults are the results of the handler's
// statements, read under ctx (one mayCut watches): a failure met while
// reading them is noted by sawCut.
type cutRows struct {
	pgx.Rows
	q   *queueTx
	ctx context.Context
}

func (r *cutRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.q.sawCut(r.ctx, r.Err())
	return false
}

func (r *cutRows) Close() {
	r.Rows.Close()
	r.q.sawCut(r.ctx, r.Err())
}

type cutRow struct {
	row pgx.Row
	q   *queueTx
	ctx context.Context
}

func (r cutRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...)
	r.q.sawCut(r.ctx, err)
	return err
}

type cutBatchResults struct {
	pgx.BatchResults
	q   *queueTx
	ctx context.Context
}

func (b *cutBatchResults) Exec() (pgconn.CommandTag, error) {
	ct, err := b.BatchResults.Exec()
	b.q.sawCut(b.ctx, err)
	return ct, err
}

func (b *cutBatchResults) Query() (pgx.Rows, error) {
	rows, err := b.BatchResults.Query()
	b.q.sawCut(b.ctx, err)
	return &cutRows{Rows: rows, q: b.q, ctx: b.ctx}, err
}

func (b *cutBatchResults) QueryRow() pgx.Row {
	return cutRow{row: b.BatchResults.QueryRow(), q: b.q, ctx: b.ctx}
}

func (b *cutBatchResults) Close() error {
	err := b.BatchResults.Close()
	b.q.sawCut(b.ctx, err)
	return err
}

// errRows is the pgx.Rows and pgx.Row of a refused query.
type errRows struct{ err error }

func (errRows) Close()                                       {}
func (r errRows) Err() error                                 { return r.err }
func (errRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (errRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (errRows) Next() bool                                   { return false }
func (r errRows) Scan(...any) error                          { return r.err }
func (r errRows) Values() ([]any, error)                     { return nil, r.err }
func (errRows) RawValues() [][]byte                          { return nil }
func (errRows) TypeMap() *pgtype.Map                         { return nil }
func (errRows) Conn() *pgx.Conn                              { return nil }

// errBatchResults is the pgx.BatchResults of a refused batch.
type errBatchResults struct{ err error }

func (r errBatchResults) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, r.err }
func (r errBatchResults) Query() (pgx.Rows, error)         { return errRows(r), r.err }
func (r errBatchResults) QueryRow() pgx.Row                { return errRows(r) }
func (errBatchResults) Tx() pgx.Tx                         { return nil }
func (r errBatchResults) Close() error                     { return r.err }

// Call runs h for ev in tx as the consumer runs a handler: what h queues
// with Event.Queue is sent before Call returns, and the failure of a queued
// statement or of its callback is returned as h's error; a panic of h is
// returned as a *PanicError, and what h queued is then not sent; h's calls
// of Commit or Rollback are refused (ErrTxOwnedByConsumer) and fail it
// permanently, as does a statement of its own that ended tx (COMMIT,
// ROLLBACK); h returning nil with tx unable to commit (a failed
// statement's error swallowed, rows left open) fails it too. It claims
// nothing and neither commits nor rolls back tx. Use it to test a handler
// against a real database with an Event built by hand, or to run a
// handler inside a transaction of your own. A nil h or tx is an error
// wrapping ErrInvalidConfig.
func Call[T any](ctx context.Context, tx pgx.Tx, h Handler[T], ev Event[T]) error {
	if h == nil || tx == nil {
		return fmt.Errorf("%w: consumer.Call needs a handler and a transaction", ErrInvalidConfig)
	}
	qtx := newQueueTx(tx)
	qtx.handlerDone = ctx.Done() // h's own context, as callHandler's is
	ev.queue = openQueue(qtx)
	err := func() (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = &PanicError{Value: r, Stack: string(debug.Stack())}
			}
		}()
		return h(ctx, qtx, ev)
	}()
	ev.queue.close()
	qtx.checkEnd(ctx)
	if err == nil && qtx.ended {
		err = brokenTxError(ErrTxOwnedByConsumer)
	}
	if err = qtx.settle(ctx, err); err == nil {
		// Left unable to commit, or ended, as the consumer would find it.
		err = brokenTxError(qtx.broken())
	}
	return err
}
