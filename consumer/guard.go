package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/dedup"
)

// The crash guard is the pipeline's second stage. A message that kills the
// process (a panic in a goroutine the handler started, an OOM kill, a
// stall past a rebalance or past the broker's consumer_timeout) leaves no
// error to count: only a durable record,
// written before the message runs, can tell the next process that it was
// in flight when the last one died. Such records cost a statement, so the
// guard keeps them only for messages that may have been in flight at a
// crash: the first Config.Batch.Size new messages of each new assignment of
// a stream (Kafka resumes from the last committed offset, so a crashed
// batch comes first), and messages the broker marks as redelivered (AMQP).
//
// A suspect, a message with a record from an earlier process, runs
// isolated: no other transaction of the consumer runs while one of its
// attempts does, so a crash is charged to it alone and never to a message
// that merely ran beside it. Isolation holds for one attempt only, never
// across the waits between attempts, nor while a dead letter is written.
//
// The record holds two counts: runs (the handler's runs, for
// Config.Retry.MaxAttempts, so that runs cut short by crashes count too) and
// crashes (runs that never finished: written as one more before an
// isolated attempt and taken back when the attempt ends in this process,
// unless the shutdown deadline, or the broker taking its delivery back as
// unacked too long (ErrDeliveryTimedOut), cut it while its handler ran).
// The first Batch.Size messages of an assignment are marked with zero
// counts, in one statement: a crash of that shared batch is charged to none
// of them as a crash (each is charged one run, which alone never spends
// Retry.MaxAttempts: the message may not have run), but their marks make
// each a suspect next time. A message with Config.CrashGuard.MaxCrashes crashes, or
// whose runs are spent with some of them cut short, is dead-lettered with
// kind KindCrashLoop; one whose runs were all spent by failures of its
// handler (the process ended, or the delivery was lost, before its dead
// letter was written) with kind KindHandler, without another run, and
// with the last run's failure: this process's if it gave the message up
// (see given), else the one the record keeps (schema version 5).
// Every count is written as a value, not an increment, so a retried write
// whose first reply was lost counts once.
type crashGuard struct {
	p *pipeline
	// isolation is held shared by every transaction and exclusively by a
	// suspect's attempt.
	isolation                                       sync.RWMutex
	markSQL, lookupSQL, setSQL, clearSQL, unmarkSQL string
	// given holds the dead letters of messages whose runs were spent in
	// this process, from when they were given up until the dead letter
	// was written: a delivery lost meanwhile comes back with its runs
	// spent, and its dead letter then carries the error of its last run,
	// which the record does not keep. At most maxGiven, the oldest
	// forgotten first (messages whose redelivery went to another
	// process).
	givenMu sync.Mutex
	given   map[string]DeadLetter
	givenQ  []string
	// lockConn holds the lock of the suspect attempt in flight
	// (lockAttempt); used only under isolation held exclusively, so by
	// one attempt at a time. Nil until the first, or after it broke.
	lockConn *pgx.Conn
	locked   bool
	// table is the oid of the store's attempts table, read at start
	// (bindTable): part of the attempt lock's key, which is the message's
	// in its store. A consumer of the same name on another store of the
	// database (a schema per tenant, per parallel test) shares no record
	// with this one, and must not wait for its attempts.
	table uint32
}

// maxGiven bounds crashGuard.given.
const maxGiven = 1024

// guardState is what the crash guard knows of a job.
type guardState struct {
	// suspect: an earlier process may have died with the message in
	// flight; it runs isolated.
	suspect bool
	// recorded: a record exists, to be deleted with the message's effects.
	recorded bool
	// known: crashes and runs were read from the record.
	known bool
	// crashes is the record's crash count.
	crashes int
	// inFlight: the record counts the attempt running now as a crash, to
	// be taken back if the attempt ends in this process.
	inFlight bool
	// runs is the record's run count as this process last read or wrote
	// it, and runsBefore what it was before the attempt in flight: a lost
	// attempt puts it back.
	runs, runsBefore int
	// lastError is the failure of the last run the record keeps (JSON, a
	// lastFailure), nil when it keeps none.
	lastError []byte
	// marked: the record counts no run of the message alone: it is the
	// bare mark of a shared batch that crashed, perhaps with crashes of
	// attempts alone that lost their session (no runs). The message may
	// not even have run, and the run the record implies spends none of
	// Retry.MaxAttempts.
	marked bool
	// lost counts the crashes of this process's attempts that lost their
	// session (txResult.lost), for the dead letter's words.
	lost int
}

func newCrashGuard(p *pipeline) *crashGuard {
	a := p.cfg.Store.AttemptsTable()
	return &crashGuard{
		p: p,
		// The SELECT sees the table as it was before the INSERT: it
		// returns the records of earlier processes, not the marks.
		markSQL: `WITH marked AS (
	INSERT INTO ` + a + ` (consumer, event_id, attempts, crashes)
	SELECT $1, id, 0, 0 FROM (SELECT DISTINCT id FROM unnest($2::text[]) AS u(id)) d ORDER BY id COLLATE "C"
	ON CONFLICT (consumer, event_id) DO NOTHING
)
SELECT event_id, attempts, crashes, last_error FROM ` + a + ` WHERE consumer = $1 AND event_id = ANY($2::text[])`,
		lookupSQL: `SELECT event_id, attempts, crashes, last_error FROM ` + a + ` WHERE consumer = $1 AND event_id = ANY($2::text[])`,
		// A write without a failure ($5 NULL) keeps the one recorded.
		setSQL: `INSERT INTO ` + a + ` AS r (consumer, event_id, attempts, crashes, last_error) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (consumer, event_id) DO UPDATE SET attempts = $3, crashes = $4, last_error = coalesce(EXCLUDED.last_error, r.last_error), last_seen = now()`,
		clearSQL:  `DELETE FROM ` + a + ` WHERE consumer = $1 AND event_id = ANY($2::text[])`,
		unmarkSQL: `DELETE FROM ` + a + ` WHERE consumer = $1 AND event_id = $2 AND attempts = 0 AND crashes = 0`,
	}
}

// record is one row of the attempts table.
type record struct {
	runs, crashes int
	lastError     []byte
}

// plan sorts jobs (in stream order) into runs: consecutive jobs that may
// share a transaction, and suspects, each alone. With window set (the
// first messages of a stream's assignment) it marks them first. Messages
// the broker says were delivered before are suspects too. It returns nil
// when ctx ended first; the jobs are then left to be abandoned.
func (g *crashGuard) plan(ctx context.Context, jobs []*job, window bool) [][]*job {
	var ids []string
	for _, j := range jobs {
		if window || mayBeRedelivery(j.m) {
			ids = append(ids, j.idt.id)
		}
	}
	if len(ids) > 0 {
		sql := g.lookupSQL
		if window {
			sql = g.markSQL
		}
		records, ok := g.read(ctx, sql, ids)
		if !ok {
			return nil
		}
		for _, j := range jobs {
			r, found := records[j.idt.id]
			j.guard.recorded = window || found
			j.guard.suspect = found || mayBeRedelivery(j.m)
			if found {
				// It ran at least once, in the run that crashed.
				j.guard.known = true
				j.guard.crashes = r.crashes
				j.guard.marked = r.runs == 0
				j.guard.runs = r.runs
				j.guard.lastError = r.lastError
				j.runs = max(j.runs, r.runs, 1)
			}
		}
	}
	var runs [][]*job
	start := 0
	for i, j := range jobs {
		if !j.guard.suspect {
			continue
		}
		if i > start {
			runs = append(runs, jobs[start:i])
		}
		runs = append(runs, jobs[i:i+1])
		start = i + 1
	}
	if start < len(jobs) {
		runs = append(runs, jobs[start:])
	}
	return runs
}

// read runs a statement returning records, retrying infrastructure
// failures; it reports false when ctx ended first.
func (g *crashGuard) read(ctx context.Context, sql string, ids []string) (map[string]record, bool) {
	records := map[string]record{}
	err := g.p.infra(ctx, "reading crash-guard records", Retry{Messages: len(ids)}, func() error {
		clear(records)
		return g.p.onConn(ctx, func(ctx context.Context, conn *pgxpool.Conn) error {
			rows, err := conn.Query(ctx, sql, g.p.cfg.Name, ids)
			if err != nil {
				return err
			}
			var id string
			var r record
			_, err = pgx.ForEachRow(rows, []any{&id, &r.runs, &r.crashes, &r.lastError}, func() error {
				records[id] = r
				return nil
			})
			return err
		})
	})
	return records, err == nil
}

// errCrashLoop says a suspect has crashed the process too often.
var errCrashLoop = errors.New("crash loop")

// errRunsSpent says a suspect's runs were all spent by failures of its
// handler, none cut short.
var errRunsSpent = errors.New("runs spent")

// enter takes the isolation a job's attempt needs: exclusive for a
// suspect, whose attempt is then recorded durably as a crash until it
// ends; shared otherwise (j nil or not a suspect). It returns errCrashLoop
// or errRunsSpent when the suspect is to be dead-lettered, errStopping or
// ctx's error; without an error, leave(j) must follow.
func (g *crashGuard) enter(ctx context.Context, j *job) error {
	if j == nil || !j.guard.suspect {
		g.isolation.RLock()
		return nil
	}
	g.isolation.Lock()
	if ctx.Err() != nil || g.p.stopping.Load() {
		// The consumer began stopping while the suspect waited: its
		// attempt never starts, so nothing is charged to it.
		g.isolation.Unlock()
		return errStopping
	}
	if err := g.startAttempt(ctx, j); err != nil {
		g.unlockAttempt()
		g.isolation.Unlock()
		return err
	}
	return nil
}

// leave ends what enter(j) began. What the attempt recorded must be final
// by then (endAttempt, forget): another process waits for it.
func (g *crashGuard) leave(j *job) {
	if j == nil || !j.guard.suspect {
		g.isolation.RUnlock()
		return
	}
	g.unlockAttempt()
	g.isolation.Unlock()
}

// lockAttempt takes the lock every attempt of a suspect holds, in any
// process of the consumer (the message's in its store: see lockID), from
// before it reads the message's record until what it recorded there is
// final. A process that is alive keeps
// its attempt's crash in the record only while the attempt runs: another
// process (or this one, the delivery lost and given again) that read the
// record meanwhile took a running attempt for a crashed one, and a
// message whose connection was cut while it ran was charged a crash, or
// dead-lettered as a crash loop. The lock is held in a transaction (so a
// pooler in transaction mode keeps it on one server session) on a
// connection of its own, outside the pool, which the attempt's own
// transaction may need whole; a process that dies releases it with its
// session. When the lock cannot be had (the connection refused), the
// attempt goes on without it, as before there was one.
func (g *crashGuard) lockAttempt(ctx context.Context, j *job) error {
	// The shutdown ends the waits below, as it ends a wait for the
	// isolation (enter): the attempt has not started. The wait for the
	// lock may last as long as the other process's attempt, and held
	// Run's return until ShutdownTimeout.
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g.p.cancelOnStop(sctx, cancel)
	if err := g.begin(sctx); err != nil {
		// The connection kept since the last attempt may have been
		// ended meanwhile (idle_session_timeout, a restart): once more
		// on a new one.
		g.dropLockConn()
		if err = g.begin(sctx); err != nil {
			return g.withoutLock(ctx, j, err)
		}
	}
	g.locked = true
	// Waits for an attempt of the message running in another process:
	// no longer than such an attempt may run, so that a connection whose
	// server vanished without a word holds no stream for ever.
	lctx, cancelLock := sctx, context.CancelFunc(func() {})
	if d := g.p.cfg.HandlerTimeout; d > 0 && g.p.cfg.DatabaseTimeout > 0 {
		lctx, cancelLock = context.WithTimeout(sctx, d+2*g.p.cfg.DatabaseTimeout)
	}
	defer cancelLock()
	if _, err := g.lockConn.Exec(lctx, `SELECT pg_advisory_xact_lock(hashtext($1), hashtext($2))`, g.p.cfg.Name, g.lockID(j.idt.id)); err != nil {
		return g.withoutLock(ctx, j, err)
	}
	return nil
}

// lockID is what the second key of an attempt's lock is a hash of: the
// event id in the store's attempts table. By the table's oid, not its
// name: processes that name one table differently ("" on the search_path
// and "public") exclude each other.
func (g *crashGuard) lockID(id string) string {
	return strconv.FormatUint(uint64(g.table), 10) + ":" + id
}

// bindTable reads the oid of the store's attempts table (see table),
// through the pool, whose sessions find the table as the consumer's
// statements do (the lock connection, opened without the pool's hooks,
// may have another search_path). Run calls it at start, once the tables
// are there.
func (g *crashGuard) bindTable(ctx context.Context) error {
	var oid *uint32
	a := g.p.cfg.Store.AttemptsTable()
	if err := g.p.pool.QueryRow(ctx, `SELECT to_regclass($1)::oid`, a).Scan(&oid); err != nil {
		return fmt.Errorf("reading the oid of %s: %w", a, err)
	}
	if oid == nil {
		return fmt.Errorf("%w: %s does not exist", dedup.ErrSchemaMismatch, a)
	}
	g.table = *oid
	return nil
}

// begin opens the lock connection's transaction, connecting first when
// there is no connection. Both are bounded by DatabaseTimeout, as the
// pool's dials are: the attempt holds the isolation every other message
// needs, and a dial to a server that never answers would hold it for
// ever.
func (g *crashGuard) begin(ctx context.Context) error {
	if d := g.p.cfg.DatabaseTimeout; d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
	}
	if g.lockConn == nil {
		conn, err := g.p.connectAlone(ctx)
		if err != nil {
			return err
		}
		g.lockConn = conn
	}
	_, err := g.lockConn.Exec(ctx, `BEGIN`)
	return err
}

// withoutLock drops the lock connection after err: the attempt goes on
// without the lock, unless ctx ended or the consumer began stopping
// (errStopping: the attempt never starts).
func (g *crashGuard) withoutLock(ctx context.Context, j *job, err error) error {
	g.dropLockConn()
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if g.p.stopping.Load() {
		return errStopping
	}
	g.p.cfg.Telemetry.Logger.DebugContext(ctx, "once: a suspect's attempt goes on without its lock", "consumer", g.p.cfg.Name,
		"event_id", j.idt.id, "error", err)
	return nil
}

// unlockAttempt releases what lockAttempt took.
func (g *crashGuard) unlockAttempt() {
	if !g.locked {
		return
	}
	g.locked = false
	ctx, cancel := context.WithTimeout(context.Background(), g.p.cfg.InfraBackoff.Max)
	defer cancel()
	if _, err := g.lockConn.Exec(ctx, `ROLLBACK`); err != nil {
		g.dropLockConn()
	}
}

// dropLockConn closes the lock connection; the next attempt opens another.
func (g *crashGuard) dropLockConn() {
	g.locked = false
	if g.lockConn == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), g.p.cfg.InfraBackoff.Max)
	defer cancel()
	_ = g.lockConn.Close(ctx)
	g.lockConn = nil
}

// close closes the lock connection when Run ends.
func (g *crashGuard) close() {
	g.isolation.Lock()
	defer g.isolation.Unlock()
	g.dropLockConn()
}

// startAttempt records j's coming attempt as a crash, to be taken back by
// endAttempt.
func (g *crashGuard) startAttempt(ctx context.Context, j *job) error {
	if err := g.lockAttempt(ctx, j); err != nil {
		return err
	}
	// Read again under the lock: what plan read may have counted an
	// attempt that was running then.
	records, ok := g.read(ctx, g.lookupSQL, []string{j.idt.id})
	if !ok {
		// Cut short by ctx, or by the shutdown (ctx still live):
		// the attempt never starts.
		if err := ctx.Err(); err != nil {
			return err
		}
		return errStopping
	}
	r := records[j.idt.id]
	j.guard.known, j.guard.crashes, j.guard.runs, j.runs = true, r.crashes, r.runs, max(j.runs, r.runs)
	j.guard.lastError, j.guard.marked = r.lastError, r.runs == 0
	spent := j.runs >= g.p.cfg.Retry.MaxAttempts && !j.guard.marked
	switch {
	case j.guard.crashes >= g.p.cfg.CrashGuard.MaxCrashes, spent && j.guard.crashes > 0:
		// Too many crashes alone, or runs spent, some of them cut
		// short. The run a shared batch's mark stands for is not enough
		// alone (it is all of Retry.MaxAttempts 1): the message may
		// never have run, and a crash of the batch is charged to none of
		// its messages.
		return errCrashLoop
	case spent:
		// Every run ended in a failure of the handler, the last one in
		// a process that ended before dead-lettering the message.
		return errRunsSpent
	}
	if err := g.set(ctx, j, j.runs+1, j.guard.crashes+1, nil); err != nil {
		return err
	}
	j.guard.crashes++
	j.guard.runsBefore, j.guard.runs = j.guard.runs, j.runs+1
	j.guard.recorded, j.guard.inFlight, j.guard.marked = true, true, false
	return nil
}

// suspectLost makes j a suspect after its transaction lost its session
// twice while its handler's work was under way (txResult.lost): the process
// lives on, but a statement of the handler's may have ended the session,
// or crashed the server, and would do it again on every retry. Running
// alone, an attempt that loses its session again is charged as a crash.
func (g *crashGuard) suspectLost(j *job) {
	j.guard.suspect = true
}

// endAttempt takes back the crash recorded for j's attempt, which ended in
// this process without committing (r). A failed run of the handler still
// counts: j.guard.runs counts it (startAttempt wrote it so), which j.runs
// does not yet, and a process that dies before the next attempt must not
// take the run with it; the record keeps its failure, for the dead letter
// of a message whose runs that process spent. An infrastructure failure is
// no run: the record goes back to its runs from before. An attempt that
// lost its session (r.lost) keeps its crash: it ran alone, so whatever
// ended the session (a statement that crashes the server) was its work or
// came from outside the consumer, and CrashGuard.MaxCrashes of them in a
// row is no coincidence. A record left behind errs on the side of
// dead-lettering later.
func (g *crashGuard) endAttempt(ctx context.Context, j *job, r txResult) {
	if !j.guard.inFlight {
		return
	}
	j.guard.inFlight = false
	var failure []byte
	taken := 1
	switch {
	case r.outcome == txInfra && r.lost:
		// No run either: a failover may end a session too, and
		// Retry.MaxAttempts 1 would then spend the message's runs. A
		// record back to no run is a mark again, as the next process
		// reads it: the run a mark implies spends nothing.
		j.guard.runs = j.guard.runsBefore
		j.guard.marked = j.guard.runs == 0
		j.guard.lost++
		taken = 0
	case r.outcome == txInfra:
		j.guard.runs = j.guard.runsBefore
	case r.err != nil:
		failure = encodeLastFailure(handlerDeadLetter(j, r.err))
	}
	ctx, cancel := g.p.detached(ctx)
	defer cancel()
	if err := g.set(ctx, j, j.guard.runs, j.guard.crashes-taken, failure); err == nil {
		j.guard.crashes -= taken
		if failure != nil {
			j.guard.lastError = failure
		}
	}
}

// forget takes back what was recorded for j, whose handling ended without
// a crash and without an effect (its delivery was lost, the consumer
// stopped): neither a crash nor the interrupted run is charged. Best
// effort, outside any transaction.
func (g *crashGuard) forget(j *job) {
	if !j.guard.recorded || j.stalled {
		return
	}
	// Bounded for each message, and by the shutdown deadline for all.
	ctx, cancelAtDeadline := g.p.detached(context.Background())
	defer cancelAtDeadline()
	ctx, cancel := context.WithTimeout(ctx, g.p.cfg.InfraBackoff.Max)
	defer cancel()
	var err error
	switch {
	case j.guard.inFlight:
		// Back to what the record held before the attempt: an earlier
		// process's crashed runs stay counted.
		err = g.set(ctx, j, j.guard.runsBefore, j.guard.crashes-1, nil)
		j.guard.inFlight = false
	case !j.guard.known:
		_, err = g.p.pool.Exec(ctx, g.unmarkSQL, g.p.cfg.Name, j.idt.id)
	}
	if err != nil {
		g.p.cfg.Telemetry.Logger.DebugContext(ctx, "once: taking back a crash-guard record", "consumer", g.p.cfg.Name,
			"event_id", j.idt.id, "error", err)
	}
}

// set writes j's record with the given counts and, unless it is nil, the
// failure of its last run (JSON), retrying infrastructure failures until
// ctx ends.
func (g *crashGuard) set(ctx context.Context, j *job, runs, crashes int, failure []byte) error {
	return g.p.infra(ctx, "writing a crash-guard record", Retry{EventID: j.idt.id, Message: j.m, Messages: 1}, func() error {
		return g.p.onConn(ctx, func(ctx context.Context, conn *pgxpool.Conn) error {
			_, err := conn.Exec(ctx, g.setSQL, g.p.cfg.Name, j.idt.id, runs, crashes, failure)
			return err
		})
	})
}

// clearIn deletes, in tx, the records of the jobs that have one: they go
// when the effects commit.
func (g *crashGuard) clearIn(ctx context.Context, tx pgx.Tx, jobs []*job) error {
	var ids []string
	for _, j := range jobs {
		if j.guard.recorded {
			ids = append(ids, j.idt.id)
		}
	}
	if len(ids) == 0 {
		return nil
	}
	_, err := tx.Exec(ctx, g.clearSQL, g.p.cfg.Name, ids)
	return err
}

// settled deletes j's record once it was settled outside a transaction
// (dead-lettered), retrying failures as the guard's other writes are, up
// to the shutdown deadline: a record left behind (kept for good without
// Retention.MaxAge) would dead-letter a copy of the message replayed from
// the dead letters, once the crash guard meets it, without running it.
func (g *crashGuard) settled(ctx context.Context, j *job) {
	g.forgetGiven(j)
	if !j.guard.recorded {
		return
	}
	j.guard.recorded, j.guard.inFlight = false, false
	ctx, cancel := g.p.detached(ctx)
	defer cancel()
	err := g.p.infra(ctx, "deleting a crash-guard record", Retry{EventID: j.idt.id, Message: j.m, Messages: 1}, func() error {
		return g.p.onConn(ctx, func(ctx context.Context, conn *pgxpool.Conn) error {
			_, err := conn.Exec(ctx, g.clearSQL, g.p.cfg.Name, []string{j.idt.id})
			return err
		})
	})
	if err != nil {
		g.p.cfg.Telemetry.Logger.DebugContext(ctx, "once: deleting a crash-guard record", "consumer", g.p.cfg.Name,
			"event_id", j.idt.id, "error", err)
	}
}

// giveUp remembers dl, the dead letter of j, given up after its runs
// were spent, until the dead letter is written (settled).
func (g *crashGuard) giveUp(j *job, dl *DeadLetter) {
	g.givenMu.Lock()
	defer g.givenMu.Unlock()
	if g.given == nil {
		g.given = map[string]DeadLetter{}
	}
	if _, ok := g.given[j.idt.id]; !ok {
		g.givenQ = append(g.givenQ, j.idt.id)
	}
	g.given[j.idt.id] = DeadLetter{Kind: dl.Kind, Error: dl.Error, Stack: dl.Stack, Extra: maps.Clone(dl.Extra)}
	for len(g.givenQ) > maxGiven {
		delete(g.given, g.givenQ[0])
		g.givenQ = g.givenQ[1:]
	}
}

// forgetGiven drops what giveUp remembered of j.
func (g *crashGuard) forgetGiven(j *job) {
	g.givenMu.Lock()
	defer g.givenMu.Unlock()
	if _, ok := g.given[j.idt.id]; !ok {
		return
	}
	delete(g.given, j.idt.id)
	g.givenQ = slices.DeleteFunc(g.givenQ, func(id string) bool { return id == j.idt.id })
}

// runsSpent is the dead letter of a suspect whose runs were all spent by
// failures of its handler: with the error of its last run when this
// process gave it up (its delivery was lost before the dead letter was
// written), else with the one the record keeps; saying that the error is
// not known when the record keeps none (written before schema version 5).
func (g *crashGuard) runsSpent(j *job) *DeadLetter {
	g.givenMu.Lock()
	given, ok := g.given[j.idt.id]
	g.givenMu.Unlock()
	if ok {
		given.Attempts = j.runs
		given.Extra = maps.Clone(given.Extra)
		return &given
	}
	if dl := decodeLastFailure(j.guard.lastError); dl != nil {
		dl.Attempts = j.runs
		return dl
	}
	return &DeadLetter{Kind: KindHandler, Attempts: j.runs,
		Error: fmt.Sprintf("the handler failed %d times (Retry.MaxAttempts); the process that ran it last ended "+
			"before dead-lettering it, and the last error is not known", j.runs)}
}

// crashLoop is the dead letter of a suspect with too many crashes.
func crashLoop(j *job) *DeadLetter {
	why := "process crash, stall, or delivery unacked past the broker's timeout"
	if j.guard.lost > 0 {
		why = fmt.Sprintf("%d of them by the database connection lost with its session while the message ran alone: "+
			"a statement of its handler's that ends its server process or crashes the server; else a process crash, "+
			"stall, or delivery unacked past the broker's timeout", j.guard.lost)
	}
	return &DeadLetter{Kind: KindCrashLoop, Attempts: j.runs,
		Error: fmt.Sprintf("handling was cut short %d times (%s)", j.guard.crashes, why)}
}

// mayBeRedelivery reports whether the broker says m may have been
// delivered before.
func mayBeRedelivery(m *Message) bool {
	return m.Redelivered || m.DeliveryCount > 0
}

// lastFailure is the failure of a message's last run as its crash-guard
// record keeps it (the attempts table's last_error).
type lastFailure struct {
	Kind  ErrorKind         `json:"kind"`
	Error string            `json:"error"`
	Stack string            `json:"stack,omitempty"`
	Extra map[string]string `json:"extra,omitempty"`
}

// encodeLastFailure is dl as the record keeps it: each text cut as the
// dead letter's headers cut it, and made storable (jsonb takes neither a
// NUL nor bytes that are not UTF-8).
func encodeLastFailure(dl *DeadLetter) []byte {
	f := lastFailure{Kind: dl.Kind, Error: storableText(dl.Error), Stack: storableText(dl.Stack)}
	if len(dl.Extra) > 0 {
		f.Extra = make(map[string]string, len(dl.Extra))
		for k, v := range dl.Extra {
			f.Extra[storableText(k)] = storableText(v)
		}
	}
	b, err := json.Marshal(f)
	if err != nil {
		return nil // strings and a map of strings always marshal
	}
	return b
}

// decodeLastFailure is the dead letter a record's last_error describes, nil
// when there is none (or it cannot be read).
func decodeLastFailure(b []byte) *DeadLetter {
	if len(b) == 0 {
		return nil
	}
	var f lastFailure
	if err := json.Unmarshal(b, &f); err != nil || f.Kind == "" {
		return nil
	}
	return &DeadLetter{Kind: f.Kind, Error: f.Error, Stack: f.Stack, Extra: f.Extra}
}

// storableText is s cut as a header is (to maxHeaderText bytes, without
// bytes that are not UTF-8), with each NUL replaced.
func storableText(s string) string {
	return strings.ReplaceAll(truncate(s, maxHeaderText), "\x00", "\uFFFD")
}
