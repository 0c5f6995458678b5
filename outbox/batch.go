package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// relaySQL are the relay's statements on one table.
type relaySQL struct {
	fetch, fetchMarking, remove, markSent, reject, cleanup string
}

// newRelaySQL returns the statements on table t. Each ends with a guard
// whose two parameters are the table's name and the oid the relay's
// session found for it (Relay.oid), which the leader lock is keyed by: on a
// table dropped and made again under that name since, a statement reads
// and changes nothing (the relay then ends its session and looks the table
// up again), so that a leader never publishes or settles rows of a table
// whose lock it does not hold.
func newRelaySQL(t string) relaySQL {
	guard := func(n int) string {
		return fmt.Sprintf("\n\tAND (SELECT to_regclass($%d)::oid) = $%d::oid", n, n+1)
	}
	// A read takes at most BatchSize rows, and stops at the first row
	// past readBudget bytes of bodies (the first row is always read):
	// the read is bounded by statementTimeout, and a batch of large rows
	// that outlasts it would be cut and read again for ever.
	ready := `	SELECT r.seq, r.event_id, r.topic, r.routing_key, r.key, r.type, r.headers, r.trace, r.body,
		r.created_at, r.attempts
	FROM (SELECT o.seq, o.event_id, o.topic, o.routing_key, o.key, o.type, o.headers, o.trace, o.body,
		o.created_at, o.attempts, sum(octet_length(o.body)) OVER (ORDER BY o.seq) - octet_length(o.body) AS before
	FROM ` + t + ` o
	WHERE o.sent_at IS NULL AND o.parked_at IS NULL AND NOT o.waiting
		AND (o.not_before IS NULL OR o.not_before <= now())
		AND (o.key IS NULL OR NOT EXISTS (
			SELECT 1 FROM ` + t + ` e
			WHERE e.topic = o.topic AND e.key = o.key AND e.seq < o.seq AND e.sent_at IS NULL
				AND (e.attempts > 0 OR e.parked_at IS NOT NULL)))
		AND (o.seq > $2 OR NOT o.seq = ANY($3::bigint[]))` + guard(4) + `
	ORDER BY o.seq
	LIMIT $1) r
	WHERE r.before < ` + strconv.Itoa(readBudget) + `
	ORDER BY r.seq`
	return relaySQL{
		// Rows in sequence order, but none behind an earlier row of its key
		// that the broker has rejected (parked, or to be retried): such a
		// row is retried without the rows behind it, which follow once it
		// is sent or discarded. That keeps each key's order across
		// rejections and lets every other key go on.
		// Rows the relay found waiting behind such a row (waiting) are
		// not in the index it reads (see fetchMarking).
		fetch: strings.TrimSpace(ready),
		// fetchMarking is fetch that also marks waiting the rows it
		// passes over on the way because they wait behind a refused row
		// of their key: that takes them out of the index the reads walk
		// (the ready index), so that the next reads do not pass over them
		// again. (A refused row that stops holding its key back gives
		// them back: a trigger, see migrations/002_waiting.up.sql.) The
		// refused row they wait for is locked FOR SHARE while they are
		// marked: a requeue or discard of it that commits first leaves
		// them unmarked, and one that commits after finds them marked and
		// gives them back. A refused row another transaction holds (a
		// requeue not committed yet, the row edited by hand in a
		// transaction left open) is skipped (SKIP LOCKED): nothing is
		// marked behind it by this read, which does not wait for it; nor
		// for a row to mark that another transaction holds, left unmarked
		// (waiting, the read failed at lock_timeout, and so did every
		// marking read after it: no key was published while the lock
		// lasted).
		// The relay marks at most once a second
		// (markEvery): planning the marking costs a read about as much as
		// the read itself.
		// It also gives back the waiting rows of each key that no
		// refused row is ahead of any more (released): the triggers that
		// give them back read the snapshot of the transaction that ends
		// the refusal, and one taken before the rows were marked (a
		// Requeue or Discard in a REPEATABLE READ transaction that first
		// listed the parked rows) finds none of them waiting, so they
		// would wait for ever. The keys are walked on the waiting index,
		// one probe each (waitkeys), a few probes per key in all.
		fetchMarking: `WITH RECURSIVE ready AS (
` + ready + `
), waitkeys(topic, key) AS (
	(SELECT k.topic, k.key FROM ` + t + ` k WHERE k.waiting ORDER BY k.topic, k.key LIMIT 1)
	UNION ALL
	SELECT n.topic, n.key FROM waitkeys p CROSS JOIN LATERAL (
		SELECT k.topic, k.key FROM ` + t + ` k
		WHERE k.waiting AND (k.topic, k.key) > (p.topic, p.key)
		ORDER BY k.topic, k.key LIMIT 1) n
), released AS (
	UPDATE ` + t + ` w SET waiting = false
	WHERE w.seq IN (
		SELECT o.seq FROM ` + t + ` o JOIN waitkeys k ON o.topic = k.topic AND o.key = k.key
		WHERE o.waiting AND NOT EXISTS (
			SELECT 1 FROM ` + t + ` e
			WHERE e.topic = k.topic AND e.key = k.key AND e.sent_at IS NULL
				AND (e.attempts > 0 OR e.parked_at IS NOT NULL)
				AND e.seq < (SELECT min(m.seq) FROM ` + t + ` m WHERE m.waiting AND m.topic = k.topic AND m.key = k.key))
		FOR UPDATE OF o SKIP LOCKED)` + guard(4) + `
), marked AS (
	UPDATE ` + t + ` w SET waiting = true
	WHERE w.seq IN (
		SELECT o.seq FROM ` + t + ` o
		WHERE o.sent_at IS NULL AND o.parked_at IS NULL AND NOT o.waiting AND o.key IS NOT NULL
			AND EXISTS (SELECT 1 FROM ` + t + ` r WHERE r.sent_at IS NULL AND (r.attempts > 0 OR r.parked_at IS NOT NULL))
			AND o.seq <= (SELECT CASE WHEN count(*) < $1 THEN 9223372036854775807 ELSE max(seq) END FROM ready)
			AND (o.seq > $2 OR NOT o.seq = ANY($3::bigint[]))
			AND EXISTS (
				SELECT 1 FROM ` + t + ` e
				WHERE e.topic = o.topic AND e.key = o.key AND e.seq < o.seq AND e.sent_at IS NULL
					AND (e.attempts > 0 OR e.parked_at IS NOT NULL)
				FOR SHARE SKIP LOCKED)
		ORDER BY o.seq
		LIMIT ` + maxMarkedPerRead + `
		FOR UPDATE SKIP LOCKED)` + guard(4) + `
)
SELECT * FROM ready ORDER BY seq`,
		remove:   `DELETE FROM ` + t + ` WHERE seq = ANY($1::bigint[])` + guard(2),
		markSent: `UPDATE ` + t + ` SET sent_at = now(), not_before = NULL WHERE seq = ANY($1::bigint[])` + guard(2),
		reject: `UPDATE ` + t + ` AS o SET attempts = o.attempts + 1, last_error = u.err,
	not_before = now() + u.delay_ms * interval '1 millisecond',
	parked_at = CASE WHEN o.attempts + 1 >= $4 THEN now() END
FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS u(seq, err, delay_ms)
WHERE o.seq = u.seq` + guard(5) + `
RETURNING o.seq, o.event_id, o.parked_at IS NOT NULL`,
		// The DELETE checks the condition again: in a partitioned table
		// each partition has rows of every ctid, and only rows sent before
		// the window may go (another partition's row of the same ctid
		// that is one goes with the chunk).
		cleanup: `DELETE FROM ` + t + ` WHERE ctid = ANY(ARRAY(
	SELECT ctid FROM ` + t + ` WHERE sent_at < now() - $1 * interval '1 millisecond' LIMIT $2))
	AND sent_at < now() - $1 * interval '1 millisecond'` + guard(3),
	}
}

// readBudget bounds the bytes of bodies one read of the outbox returns
// (but for its first row): a read is bounded by statementTimeout, so the
// rows it returns must arrive within it (16 MiB: 1.6 MB/s), whatever
// BatchSize and the size of the rows.
const readBudget = 16 << 20

// full reports whether batch is a full read: BatchSize rows, or
// readBudget bytes of bodies; the relay then reads the next at once.
func (r *Relay) full(batch []Record) bool {
	if len(batch) >= r.cfg.BatchSize {
		return true
	}
	n := 0
	for _, rec := range batch {
		n += len(rec.Body)
	}
	return n >= readBudget
}

// maxMarkedPerRead bounds the rows a read of the outbox marks waiting
// (relaySQL.fetchMarking): a table migrated with a large backlog behind a
// refused row is marked over several reads.
const maxMarkedPerRead = "10000"

// errBrokerUnavailable is relayBatch's error when records failed without
// the broker rejecting them: they stay in the outbox, uncounted.
var errBrokerUnavailable = errors.New("the broker did not confirm")

// settlement is what a published batch leaves to write: the rows the
// broker confirmed and those it rejected.
type settlement struct {
	sent    []int64
	rejects []rejection
}

// empty reports whether there is nothing to write.
func (s *settlement) empty() bool { return len(s.sent) == 0 && len(s.rejects) == 0 }

// add appends a batch's outcome to s.
func (s *settlement) add(sent []int64, rejects []rejection) {
	s.sent = append(s.sent, sent...)
	s.rejects = append(s.rejects, rejects...)
}

// relayBatch publishes batch and settles each row by its outcome:
// confirmed rows are removed (or marked sent), rejected rows charged an
// attempt, the rest left as they were. While the broker works on a full
// batch it reads the next one (ahead), leaving out the rows in flight; of
// those it returns only the rows whose key had every row of batch
// confirmed, so that nothing overtakes a row that must be sent again.
//
// It first writes *deferred, the previous batch's settlement, while the
// broker works on this batch. When the broker confirmed every row of this
// batch and the rows read ahead are not empty, it leaves this batch's
// settlement in *deferred in turn, for the next call, which the caller
// makes at once with ahead: the database then deletes one batch while the
// broker confirms the next, instead of between them. Deferring changes
// nothing that is published, only when the rows are deleted: a relay that
// dies before writing it leaves the rows to be published again, like a
// crash between the broker's confirm and the delete.
//
// A settlement the database refused (the connection still open: read-only
// after a failover, a full disk, a statement_timeout) is left in
// *deferred, this batch's outcome added to it: the caller writes it again
// before it reads the outbox, rather than read and publish the same rows
// again for as long as the database refuses.
func (r *Relay) relayBatch(ctx context.Context, conn *pgx.Conn, batch []Record, deferred *settlement) (ahead []Record, err error) {
	var sent []int64
	var rejects []rejection
	pctx, span := r.startBatchSpan(ctx, batch)
	defer func() { endBatchSpan(span, len(sent), len(rejects), err) }()
	// The publisher is called on a goroutine of its own, Check on each
	// record and then Publish, so that a call that does not return can be
	// given up (awaitCall). The checks are awaited before the settlement
	// and the read ahead, Publish after them.
	checks := make(chan checkOutcome, 1)
	published := make(chan []error, 1)
	call := new(publisherCall)
	returned := make(chan struct{})
	go func() {
		defer close(returned)
		// The publisher outlives a stop by shutdownGrace, like the wait
		// below: a publisher that watches its context (amqpout) would
		// otherwise give up on confirms the broker is about to send, and
		// leave rows the broker has to be published again.
		gctx, cancel := graceContext(pctx, shutdownGrace)
		defer cancel()
		var c checkOutcome
		c.publish, c.checked, c.unchecked = r.check(batch, call)
		checks <- c
		var errs []error
		if len(c.publish) > 0 {
			errs = r.publish(gctx, call, c.publish)
		}
		published <- errs
	}()
	w := r.newCallWait(ctx, call, returned)
	defer w.stop()
	c, err := awaitCall(w, checks)
	if err != nil {
		return nil, err
	}
	r.noteUnchecked(ctx, c.unchecked)
	publish, checked := c.publish, c.checked
	// What the broker confirmed is settled even when ctx is cancelled
	// meanwhile: a row left unmarked is published again.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	var prevErr, aheadErr error
	if r.full(batch) {
		ahead, prevErr, aheadErr = r.settleAndFetch(sctx, conn, deferred, batch)
	} else {
		prevErr = r.settleDeferred(sctx, conn, deferred)
	}
	errs, waitErr := awaitCall(w, published)
	if errors.As(waitErr, new(*hungCall)) {
		// Nothing of the batch is settled; a settlement prevErr left in
		// *deferred is written before the session ends.
		return nil, waitErr
	}
	if prevErr != nil {
		if waitErr == nil {
			s, rj, _ := sortOutcomes(publish, errs)
			deferred.add(s, append(rj, checked...))
		}
		return nil, prevErr
	}
	if waitErr != nil {
		return nil, waitErr
	}
	var failed error
	sent, rejects, failed = sortOutcomes(publish, errs)
	rejects = append(rejects, checked...)
	if failed == nil && aheadErr == nil && len(rejects) == 0 && len(sent) == len(batch) && len(ahead) > 0 {
		*deferred = settlement{sent: sent}
		return ahead, nil
	}
	if err := r.settle(sctx, conn, sent, rejects); err != nil {
		deferred.add(sent, rejects)
		return nil, err
	}
	if failed != nil {
		return nil, fmt.Errorf("%w: %w", errBrokerUnavailable, failed)
	}
	if aheadErr != nil {
		return nil, aheadErr
	}
	return withoutHeldKeys(ahead, batch, sent), nil
}

// settleAndFetch writes the deferred settlement, if any, and reads the
// next batch (leaving out inflight) in one round trip. The two statements
// run in one implicit transaction: if either fails, neither took effect,
// and settleErr says so (the settlement is then left in *deferred, to be
// written again). fetchErr is the read's error when there was nothing to
// settle.
//
// Both run under settleCtx, not the relay's context: pgx closes a
// connection whose statement is cancelled, and the batch in flight is
// settled on this connection once the broker answered, also when the relay
// is stopping; a read cut short by the stop would leave the rows the
// broker confirmed to be published again.
func (r *Relay) settleAndFetch(settleCtx context.Context, conn *pgx.Conn, deferred *settlement, inflight []Record) (
	next []Record, settleErr, fetchErr error) {
	if deferred.empty() {
		next, fetchErr = r.fetch(settleCtx, conn, inflight)
		return next, nil, fetchErr
	}
	d := *deferred
	*deferred = settlement{}
	var b pgx.Batch
	charged := r.queueSettle(&b, d.sent, d.rejects)
	r.queueFetch(&b, inflight).Query(func(rows pgx.Rows) error {
		var err error
		next, err = pgx.CollectRows(rows, scanRecord)
		return err
	})
	// A stopping relay still writes what the broker confirmed (within the
	// bound settleCtx sets).
	if err := conn.SendBatch(settleCtx, &b).Close(); err != nil {
		*deferred = d
		return nil, fmt.Errorf("settle published rows and read the next: %w", err), nil
	}
	r.reportSettled(settleCtx, d.sent, d.rejects, *charged)
	return next, nil, nil
}

// settleDeferred writes a deferred settlement, if any, and clears it once
// written.
func (r *Relay) settleDeferred(ctx context.Context, conn *pgx.Conn, deferred *settlement) error {
	if deferred.empty() {
		return nil
	}
	if err := r.settle(ctx, conn, deferred.sent, deferred.rejects); err != nil {
		return err
	}
	*deferred = settlement{}
	return nil
}

// settleTimeout bounds each statement that writes what the broker
// confirmed or refused (and the read sent with it, and a cleanup chunk),
// which runs on even when the relay is stopping.
const settleTimeout = 10 * time.Second

// statementTimeout bounds each of the relay's other statements (the reads
// of the outbox, the leader lock's, the session's setup): a session whose
// server vanished without a word reaching the relay's host (a failover's
// old primary, a middlebox that forgot the connection) leaves a statement
// on it unanswered until the operating system gives up on the connection,
// a quarter of an hour with Linux's defaults, while the server has ended
// the session and its leader lock, and no relay publishes. Past it pgx
// closes the connection, and the relay leads on a new session. The
// session's lock_timeout (below it) ends a wait for a row lock first.
const statementTimeout = settleTimeout

// bounded returns ctx bounded by statementTimeout.
func bounded(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, statementTimeout)
}

// lockTimeout is the relay session's lock_timeout: below settleTimeout, so
// that a statement waiting for a lock fails with the connection kept
// rather than having it closed by settleTimeout.
const lockTimeout = 5 * time.Second

// shutdownGrace bounds how long a stopping relay waits for the broker's
// answer to the batch in flight (a sarama producer does not watch the
// context): past it the batch is left unsettled, to be published again.
const shutdownGrace = 5 * time.Second

// graceContext returns a context with ctx's values that is cancelled
// grace after ctx is done (or when cancel is called).
func graceContext(ctx context.Context, grace time.Duration) (context.Context, context.CancelFunc) {
	gctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	// A timer left running after cancel only calls cancel again.
	stopAfter := context.AfterFunc(ctx, func() { time.AfterFunc(grace, cancel) })
	return gctx, func() {
		stopAfter()
		cancel()
	}
}

// checkOutcome is what the publisher's Checker made of a batch: the
// records to publish, those it refused, and those it could not check.
type checkOutcome struct {
	publish   []Record
	checked   []rejection
	unchecked uncheckedRecords
}

// publisherCall is the call to the publisher that a batch's goroutine is
// in, for the relay to find one that does not return.
type publisherCall struct {
	mu        sync.Mutex
	name      string // "Publish" or "Check"; "" between calls
	seq       int64  // the (first) record's seq
	records   int
	start     time.Time
	abandoned bool
}

// enter notes a call of name on recs; it returns false, and the call must
// not be made, once the relay has given up the goroutine.
func (c *publisherCall) enter(name string, recs []Record) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.abandoned {
		return false
	}
	c.name, c.seq, c.records, c.start = name, recs[0].Seq, len(recs), time.Now()
	return true
}

// leave notes that the call returned.
func (c *publisherCall) leave() {
	c.mu.Lock()
	c.name = ""
	c.mu.Unlock()
}

// abandon stops the goroutine's further calls.
func (c *publisherCall) abandon() {
	c.mu.Lock()
	c.abandoned = true
	c.mu.Unlock()
}

// running returns the call in progress, if any, and how long it has run.
func (c *publisherCall) running() (h hungCall, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.name == "" {
		return h, false
	}
	return hungCall{name: c.name, seq: c.seq, records: c.records, start: c.start, ran: time.Since(c.start)}, true
}

// errAbandoned is the outcome of a record whose call to the publisher was
// not made because the relay had given up the batch.
var errAbandoned = errors.New("outbox: the relay gave up this batch before it was published")

// hungCall is a call to the publisher that did not return within
// PublishTimeout and its grace; the relay's error when it gives it up.
type hungCall struct {
	name    string
	seq     int64
	records int
	start   time.Time
	ran     time.Duration
}

func (h *hungCall) Error() string {
	what := fmt.Sprintf("of the record of seq %d", h.seq)
	if h.records > 1 {
		what = fmt.Sprintf("of %d records from seq %d", h.records, h.seq)
	}
	return fmt.Sprintf("the publisher's %s %s has not returned after %v", h.name, what, h.ran.Round(time.Millisecond))
}

// abandonedCall is a call to the publisher the relay gave up, and the
// channel closed when its goroutine returns.
type abandonedCall struct {
	hungCall
	returned <-chan struct{}
}

// hangLimit is how long a call to the publisher may run before the relay
// gives it up: PublishTimeout, plus shutdownGrace (or PublishTimeout when
// shorter) for a publisher that watches its context to return its answer.
func (r *Relay) hangLimit() time.Duration {
	return r.cfg.PublishTimeout + min(shutdownGrace, r.cfg.PublishTimeout)
}

// callWait waits for the answers of a batch's goroutine (awaitCall): it
// gives a call to the publisher up past hangLimit, and the goroutine once
// ctx has been done for shutdownGrace.
type callWait struct {
	r        *Relay
	call     *publisherCall
	returned <-chan struct{}
	done     <-chan struct{} // ctx.Done() until it fired
	grace    *time.Timer     // started when ctx is done
}

func (r *Relay) newCallWait(ctx context.Context, call *publisherCall, returned <-chan struct{}) *callWait {
	return &callWait{r: r, call: call, returned: returned, done: ctx.Done()}
}

// stop releases the wait's timer.
func (w *callWait) stop() {
	if w.grace != nil {
		w.grace.Stop()
	}
}

// awaitCall waits for the goroutine's next answer on ch. Past
// shutdownGrace after ctx is done it gives the goroutine up (an error
// wrapping errBrokerUnavailable); when a call to the publisher has run
// past hangLimit it gives it up with a *hungCall error, noted in
// Relay.abandoned for Run to wait on before the relay leads again. A
// goroutine given up makes no further call to the publisher.
func awaitCall[T any](w *callWait, ch <-chan T) (T, error) {
	var zero T
	limit := w.r.hangLimit()
	hang := time.NewTimer(limit)
	defer hang.Stop()
	var graceC <-chan time.Time
	if w.grace != nil {
		graceC = w.grace.C
	}
	for {
		select {
		case v := <-ch:
			return v, nil
		case <-w.done:
			w.done = nil
			w.grace = time.NewTimer(shutdownGrace)
			graceC = w.grace.C
		case <-graceC:
			w.call.abandon()
			return zero, fmt.Errorf("%w: stopped before the broker answered", errBrokerUnavailable)
		case <-hang.C:
			h, ok := w.call.running()
			switch {
			case !ok:
				hang.Reset(limit)
			case h.ran < limit:
				hang.Reset(limit - h.ran)
			default:
				w.call.abandon()
				w.r.abandoned = &abandonedCall{hungCall: h, returned: w.returned}
				w.r.stalled.Store(true)
				return zero, &h
			}
		}
	}
}

// awaitAbandoned waits, when the relay gave up a call to the publisher,
// until that call returned, logging at level Error every PublishTimeout;
// false when ctx was done first.
func (r *Relay) awaitAbandoned(ctx context.Context) bool {
	a := r.abandoned
	if a == nil {
		return true
	}
	t := time.NewTicker(r.cfg.PublishTimeout)
	defer t.Stop()
	for {
		select {
		case <-a.returned:
			r.abandoned = nil
			r.stalled.Store(false)
			r.cfg.Logger.Warn("outbox relay: the publisher's call the relay gave up has returned; leading again",
				"call", a.name, "seq", a.seq, "records", a.records, "ran", time.Since(a.start).Round(time.Millisecond))
			return true
		case <-ctx.Done():
			return false
		case <-t.C:
			r.cfg.Logger.Error("outbox relay: the publisher's call the relay gave up has still not returned; "+
				"this relay does not lead until it does", "call", a.name, "seq", a.seq, "records", a.records,
				"running", time.Since(a.start).Round(time.Millisecond))
		}
	}
}

// withoutHeldKeys drops from ahead the rows of every key that has a row in
// batch the broker did not confirm: they are read again, behind it, once
// it is settled.
func withoutHeldKeys(ahead, batch []Record, sent []int64) []Record {
	if len(sent) == len(batch) || len(ahead) == 0 {
		return ahead
	}
	ok := make(map[int64]bool, len(sent))
	for _, seq := range sent {
		ok[seq] = true
	}
	held := map[string]bool{}
	for _, rec := range batch {
		if k := orderKey(rec); k != "" && !ok[rec.Seq] {
			held[k] = true
		}
	}
	out := ahead[:0]
	for _, rec := range ahead {
		if k := orderKey(rec); k == "" || !held[k] {
			out = append(out, rec)
		}
	}
	return out
}

// check runs the publisher's Checker, if it has one, over recs: a record
// it refuses (Rejected) is charged without being sent, one it cannot check
// (any other error, the first of which unchecked counts) is held for a
// later batch, and in both cases the later records of its key are held
// back (neither sent nor charged) so that they cannot overtake it. A
// record whose row could not be decoded is charged like a refusal.
func (r *Relay) check(recs []Record, call *publisherCall) (publish []Record, rejects []rejection, unchecked uncheckedRecords) {
	c, _ := r.pub.(Checker)
	if c == nil && !anyUndecodable(recs) {
		return recs, nil, unchecked
	}
	publish = recs[:0:0]
	var held map[string]bool
	for _, rec := range recs {
		k := orderKey(rec)
		if k != "" && held[k] {
			continue
		}
		err := Rejected(rec.undecodable)
		if err == nil && c != nil {
			err = checkGuarded(call, c, rec)
		}
		if err != nil {
			if IsRejected(err) {
				rejects = append(rejects, rejection{seq: rec.Seq, attempts: rec.Attempts, err: err})
			} else {
				unchecked.add(err)
			}
			if k != "" {
				if held == nil {
					held = map[string]bool{}
				}
				held[k] = true
			}
			continue
		}
		publish = append(publish, rec)
	}
	return publish, rejects, unchecked
}

// uncheckedRecords counts the records of a batch the publisher's Checker
// could not decide on, with the first error.
type uncheckedRecords struct {
	n     int
	first error
}

func (u *uncheckedRecords) add(err error) {
	if u.n == 0 {
		u.first = err
	}
	u.n++
}

// uncheckedLogEvery bounds how often held records are logged: the same
// rows are read again at every poll while the check keeps failing.
const uncheckedLogEvery = 10 * time.Second

// noteUnchecked logs, at level Warn and at most every uncheckedLogEvery,
// records held because the publisher could not check them: they are not
// charged and wait for a later batch, and without a word the outbox would
// stand still in silence.
func (r *Relay) noteUnchecked(ctx context.Context, u uncheckedRecords) {
	if u.n == 0 || time.Since(r.uncheckedLogged) < uncheckedLogEvery {
		return
	}
	r.uncheckedLogged = time.Now()
	r.cfg.Logger.WarnContext(ctx, "once/outbox: the publisher could not check records before sending them; they wait, uncharged, for a later batch",
		"records", u.n, "error", u.first)
}

// anyUndecodable reports whether a record of recs could not be decoded.
func anyUndecodable(recs []Record) bool {
	for _, rec := range recs {
		if rec.undecodable != nil {
			return true
		}
	}
	return false
}

// orderKey identifies the sequence a record keeps its order in; "" for a
// record without a key.
func orderKey(rec Record) string {
	if rec.Key == nil {
		return ""
	}
	return rec.Topic + "\x00" + string(rec.Key)
}

// rejection is a record the broker refused.
type rejection struct {
	seq      int64
	attempts int // before this one
	err      error
}

// errBrokenPublisher marks a publisher breaking Publisher's contract: the
// relay takes none of the batch's records as confirmed and charges none.
var errBrokenPublisher = errors.New("outbox: the publisher broke its contract")

// errHeld is the outcome of a record left out of a publish because an
// earlier record of its key was not confirmed: it is neither sent nor
// charged, and is read again behind that record.
var errHeld = errors.New("outbox: held behind an earlier record of its key")

// publish publishes recs with the relay's publisher. When Publish panics
// on a batch of more than one record, the batch is published again in
// halves, and each half that panics in halves again, in order, to find
// the record it panics on (about 2·log2(n) publishes for one such record
// in a batch of n, instead of n one at a time): a record whose publish
// panics alone is charged like a refusal (a poison row: parked after
// MaxAttempts, with the panic as its error), and the later records of a
// key with a record that was not confirmed are held (errHeld), so that
// they cannot overtake it. A publisher that panics on every record has
// each of them charged so (after 2n-2 publishes).
func (r *Relay) publish(ctx context.Context, call *publisherCall, recs []Record) []error {
	errs, stack, panicked := r.publishGuarded(ctx, call, recs)
	if panicked == nil {
		return errs
	}
	if len(recs) == 1 {
		r.cfg.Logger.ErrorContext(ctx, "outbox relay: the publisher's Publish panicked on a record; it is charged like a refusal",
			"seq", recs[0].Seq, "event_id", recs[0].EventID, "error", panicked, "stack", string(stack))
		return []error{Rejected(panicked)}
	}
	r.cfg.Logger.ErrorContext(ctx, "outbox relay: the publisher's Publish panicked on a batch; it is published again in halves, "+
		"and the record it panics on alone is charged like a refusal", "records", len(recs), "error", panicked, "stack", string(stack))
	a := apart{r: r, call: call, recs: recs, errs: make([]error, len(recs)), held: map[string]bool{}}
	a.halves(ctx, 0, len(recs))
	return a.errs
}

// apart publishes the records of a batch on which Publish panicked, in
// parts, to find the records it panics on.
type apart struct {
	r    *Relay
	call *publisherCall
	recs []Record
	errs []error
	// held are the keys with a record that was not confirmed.
	held map[string]bool
}

// halves publishes recs[lo:hi], on which Publish panicked, as two halves,
// in order, and each half that panics as halves again.
func (a *apart) halves(ctx context.Context, lo, hi int) {
	mid := lo + (hi-lo)/2
	for _, part := range [2][2]int{{lo, mid}, {mid, hi}} {
		if a.part(ctx, part[0], part[1]) {
			a.halves(ctx, part[0], part[1])
		}
	}
}

// part publishes the records of recs[lo:hi] that are not held behind an
// earlier record of their key, records their outcomes, and reports
// whether Publish panicked on more than one record (which the caller
// splits). A record Publish panics on alone is charged with the panic.
func (a *apart) part(ctx context.Context, lo, hi int) (split bool) {
	at := make([]int, 0, hi-lo)
	send := make([]Record, 0, hi-lo)
	for i := lo; i < hi; i++ {
		k := orderKey(a.recs[i])
		switch {
		case k != "" && a.held[k]:
			a.errs[i] = errHeld
			continue
		case ctx.Err() != nil:
			a.errs[i] = fmt.Errorf("stopped before the record was published again: %w", ctx.Err())
			a.hold(k)
			continue
		}
		at, send = append(at, i), append(send, a.recs[i])
	}
	if len(send) == 0 {
		return false
	}
	out, _, panicked := a.r.publishGuarded(ctx, a.call, send)
	if panicked != nil && len(send) > 1 {
		return true
	}
	for n, i := range at {
		switch {
		case panicked != nil:
			a.errs[i] = Rejected(panicked)
		case out != nil:
			a.errs[i] = out[n]
		}
		if a.errs[i] != nil {
			a.hold(orderKey(a.recs[i]))
		}
	}
	return false
}

// hold holds the later records of key k (none for the empty key).
func (a *apart) hold(k string) {
	if k != "" {
		a.held[k] = true
	}
}

// publishGuarded publishes recs with the relay's publisher, under a
// context with PublishTimeout's deadline. An answer of another length
// than recs (checkAnswers) takes none of recs as confirmed: errs then
// holds an error wrapping errBrokenPublisher for each. A panic in Publish
// is returned as panicked, with its stack, and errs nil. Once the relay
// has given up the batch it publishes nothing: every record's error is
// errAbandoned.
func (r *Relay) publishGuarded(ctx context.Context, call *publisherCall, recs []Record) (errs []error, stack []byte, panicked error) {
	if !call.enter("Publish", recs) {
		return fill(len(recs), errAbandoned), nil, nil
	}
	defer call.leave()
	ctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	defer cancel()
	defer func() {
		if p := recover(); p != nil {
			errs, stack, panicked = nil, debug.Stack(), fmt.Errorf("the publisher's Publish panicked: %v", p)
		}
	}()
	return checkAnswers(r.pub.Publish(ctx, recs), len(recs)), nil, nil
}

// fill returns n copies of err.
func fill(n int, err error) []error {
	errs := make([]error, n)
	for i := range errs {
		errs[i] = err
	}
	return errs
}

// checkGuarded runs c.Check on rec; a panic in it is charged to rec as a
// refusal (Rejected), as the broker would be asked the same again. Once
// the relay has given up the batch it runs nothing and returns
// errAbandoned.
func checkGuarded(call *publisherCall, c Checker, rec Record) (err error) {
	if !call.enter("Check", []Record{rec}) {
		return errAbandoned
	}
	defer call.leave()
	defer func() {
		if p := recover(); p != nil {
			err = Rejected(fmt.Errorf("the publisher's Check panicked: %v", p))
		}
	}()
	return c.Check(rec)
}

// checkAnswers returns errs when it is nil or holds one error per record
// of a batch of n; otherwise, the broker's answers no longer matched to
// their records, n errors that take none as confirmed.
func checkAnswers(errs []error, n int) []error {
	if errs == nil || len(errs) == n {
		return errs
	}
	err := fmt.Errorf("%w: Publish returned %d errors for %d records; none is taken as confirmed",
		errBrokenPublisher, len(errs), n)
	errs = make([]error, n)
	for i := range errs {
		errs[i] = err
	}
	return errs
}

// sortOutcomes splits recs by their publish result; failed is the first
// error that was not a rejection.
func sortOutcomes(recs []Record, errs []error) (sent []int64, rejects []rejection, failed error) {
	for i, rec := range recs {
		var err error
		if errs != nil {
			err = errs[i]
		}
		switch {
		case err == nil:
			sent = append(sent, rec.Seq)
		case errors.Is(err, errHeld):
		case IsRejected(err):
			rejects = append(rejects, rejection{seq: rec.Seq, attempts: rec.Attempts, err: err})
		case failed == nil:
			failed = err
		}
	}
	return sent, rejects, failed
}

// fetch reads the next batch of publishable rows, leaving out the rows of
// inflight (a batch being published).
func (r *Relay) fetch(ctx context.Context, conn *pgx.Conn, inflight []Record) ([]Record, error) {
	maxSeq, seqs := fetchArgs(inflight)
	ctx, cancel := bounded(ctx)
	defer cancel()
	rows, err := conn.Query(ctx, r.fetchSQL(), r.cfg.BatchSize, maxSeq, seqs, r.cfg.Store.table, r.oid)
	if err != nil {
		return nil, fmt.Errorf("read outbox: %w", err)
	}
	recs, err := pgx.CollectRows(rows, scanRecord)
	if err != nil {
		return nil, fmt.Errorf("read outbox: %w", err)
	}
	return recs, nil
}

// queueFetch queues fetch's statement on b.
func (r *Relay) queueFetch(b *pgx.Batch, inflight []Record) *pgx.QueuedQuery {
	maxSeq, seqs := fetchArgs(inflight)
	return b.Queue(r.fetchSQL(), r.cfg.BatchSize, maxSeq, seqs, r.cfg.Store.table, r.oid)
}

// markEvery is how often at most a read of the outbox marks the rows it
// passes over waiting (relaySQL.fetchMarking): between two such reads,
// the reads pass over at most the waiting rows written in the meantime.
const markEvery = time.Second

// fetchSQL returns the read of the outbox to send next: one that marks
// waiting rows once markEvery has passed since the last one.
func (r *Relay) fetchSQL() string {
	if now := time.Now(); now.Sub(r.markedAt) >= markEvery {
		r.markedAt = now
		return r.sql.fetchMarking
	}
	return r.sql.fetch
}

// fetchArgs are the fetch statement's arguments that leave out inflight:
// its highest seq and all its seqs.
func fetchArgs(inflight []Record) (maxSeq int64, seqs []int64) {
	seqs = make([]int64, len(inflight))
	for i, rec := range inflight {
		seqs[i] = rec.Seq
		maxSeq = max(maxSeq, rec.Seq)
	}
	return maxSeq, seqs
}

// scanRecord reads a row. A row whose headers or trace are not a JSON
// object of strings (written by plain SQL) is returned with undecodable
// set: check charges it, so that it is parked instead of failing every
// read of the outbox.
func scanRecord(row pgx.CollectableRow) (Record, error) {
	var rec Record
	var headers, trace []byte
	err := row.Scan(&rec.Seq, &rec.EventID, &rec.Topic, &rec.RoutingKey, &rec.Key, &rec.Type,
		&headers, &trace, &rec.Body, &rec.CreatedAt, &rec.Attempts)
	if err != nil {
		return rec, err
	}
	if err := unmarshalObject(headers, &rec.Headers); err != nil {
		rec.undecodable = fmt.Errorf("outbox row %d: headers are not a JSON object of strings: %w", rec.Seq, err)
		return rec, nil
	}
	var tc map[string]string
	if err := unmarshalObject(trace, &tc); err != nil {
		rec.undecodable = fmt.Errorf("outbox row %d: trace is not a JSON object of strings: %w", rec.Seq, err)
		return rec, nil
	}
	if rec.Headers == nil && len(tc) > 0 {
		rec.Headers = make(map[string]string, len(tc))
	}
	for k, v := range tc {
		rec.Headers[k] = v
	}
	return rec, nil
}

// unmarshalObject decodes a JSON object of strings into m, leaving m nil
// for the empty object most rows carry (no headers, no trace) without
// running the decoder: the relay reads thousands of rows a second.
func unmarshalObject(data []byte, m *map[string]string) error {
	if string(data) == "{}" {
		return nil
	}
	return json.Unmarshal(data, m)
}

// settle removes (or marks) the sent rows and charges the rejected ones, in
// one round trip, and logs the rows it parked.
func (r *Relay) settle(ctx context.Context, conn *pgx.Conn, sent []int64, rejects []rejection) error {
	if len(sent) == 0 && len(rejects) == 0 {
		return nil
	}
	var b pgx.Batch
	charged := r.queueSettle(&b, sent, rejects)
	if err := conn.SendBatch(ctx, &b).Close(); err != nil {
		return fmt.Errorf("settle published rows: %w", err)
	}
	r.reportSettled(ctx, sent, rejects, *charged)
	return nil
}

// errorText is err's text as the row's last_error (text) can hold it: a
// publisher's error whose Error panics (a typed nil, wrapped with
// Rejected) is described by fmt instead of crashing the relay, and bytes
// that are not UTF-8 are dropped and each NUL replaced. PostgreSQL's text
// takes neither: an error quoting a binary body failed the settlement
// that charges its row, written again after every backoff for ever, while
// the relay published nothing else.
func errorText(err error) string {
	return strings.ReplaceAll(strings.ToValidUTF8(fmt.Sprint(err), ""), "\x00", "\uFFFD")
}

// charge is a rejected row as its settlement charged it.
type charge struct {
	seq    int64
	id     string
	parked bool
}

// queueSettle queues on b the statements that settle a batch: the sent
// rows removed (or marked), the rejected ones charged. The charged rows
// are filled in when b's results are read; they are reported (logged,
// counted) only once b committed.
func (r *Relay) queueSettle(b *pgx.Batch, sent []int64, rejects []rejection) *[]charge {
	charged := new([]charge)
	if len(sent) > 0 {
		if r.cfg.KeepSent > 0 {
			b.Queue(r.sql.markSent, sent, r.cfg.Store.table, r.oid)
		} else {
			b.Queue(r.sql.remove, sent, r.cfg.Store.table, r.oid)
		}
	}
	if len(rejects) > 0 {
		seqs, msgs, delays := make([]int64, len(rejects)), make([]string, len(rejects)), make([]int64, len(rejects))
		for i, rj := range rejects {
			seqs[i], msgs[i] = rj.seq, errorText(rj.err)
			delays[i] = r.cfg.RetryBackoff.delay(rj.attempts + 1).Milliseconds()
		}
		b.Queue(r.sql.reject, seqs, msgs, delays, r.cfg.MaxAttempts, r.cfg.Store.table, r.oid).Query(func(rows pgx.Rows) error {
			var c charge
			_, err := pgx.ForEachRow(rows, []any{&c.seq, &c.id, &c.parked}, func() error {
				*charged = append(*charged, c)
				return nil
			})
			return err
		})
	}
	return charged
}

// reportSettled counts a committed settlement in the relay's metrics and
// logs each charged row, at error level when it was parked.
func (r *Relay) reportSettled(ctx context.Context, sent []int64, rejects []rejection, charged []charge) {
	r.metrics.published.Add(ctx, int64(len(sent)), r.metrics.attrs)
	r.metrics.rejected.Add(ctx, int64(len(rejects)), r.metrics.attrs)
	why := make(map[int64]error, len(rejects))
	for _, rj := range rejects {
		why[rj.seq] = rj.err
	}
	for _, c := range charged {
		if c.parked {
			r.metrics.parked.Add(ctx, 1, r.metrics.attrs)
			r.cfg.Logger.Error("outbox relay: row parked: the broker rejected it on every attempt; later rows of its key wait",
				"seq", c.seq, "event_id", c.id, "error", why[c.seq])
		} else {
			r.cfg.Logger.Warn("outbox relay: the broker rejected a row; it will be retried", "seq", c.seq, "event_id", c.id, "error", why[c.seq])
		}
	}
}

// cleanupChunk bounds the rows one cleanup statement deletes.
const cleanupChunk = 1000

// cleanupPass bounds one pass of cleanup: the relay publishes nothing
// while it deletes, so a large backlog of rows past KeepSent is removed in
// passes with publishing between them, not in one go that holds the
// outbox's latency for as long as it takes.
const cleanupPass = 100 * time.Millisecond

// cleanup deletes rows sent more than KeepSent ago, a chunk at a time, for
// at most about cleanupPass or until ctx is done; more reports that a
// chunk was full when it stopped (rows may be left for the next pass). A
// chunk runs to its end (within a bound) even when ctx is cancelled
// meanwhile: pgx closes a connection whose statement is cancelled, and the
// relay's connection may still have a settlement to write, that of a batch
// the broker confirmed (deferred to the next read).
func (r *Relay) cleanup(ctx context.Context, conn *pgx.Conn) (more bool, err error) {
	start := time.Now()
	for ctx.Err() == nil {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
		tag, err := conn.Exec(cctx, r.sql.cleanup, r.cfg.KeepSent.Milliseconds(), cleanupChunk, r.cfg.Store.table, r.oid)
		cancel()
		if err != nil {
			return false, err
		}
		if tag.RowsAffected() < cleanupChunk {
			return false, nil
		}
		if time.Since(start) >= cleanupPass {
			return true, nil
		}
	}
	return false, nil
}
