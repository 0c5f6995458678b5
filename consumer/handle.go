package consumer

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime/debug"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceco/once/dedup"
)

// job is one delivery being handled.
type job struct {
	d     Delivery
	m     *Message
	idt   identity
	fp    []byte
	call  call // nil: record the id without a handler
	event any  // the typed Event, for a BatchHandler
	// crashes is the durable attempt count recorded for this message, 0
	// when none was recorded.
	crashes int
	span    trace.Span
	// ctx carries the message's span and ends when the message is
	// abandoned.
	ctx context.Context
	// stalled: the handling was cut short while running by the shutdown
	// deadline, its delivery still live. Like a crash, it keeps its
	// durable attempt count (a handler that hangs every time is dead-
	// lettered after MaxCrashAttempts); every other abandonment gives the
	// count back.
	stalled bool
}

type resultKind int

const (
	resHandled resultKind = iota
	resSkipped
	resDuplicate
	resConflict
	resHandlerErr
	resInfraErr
	resAbandoned
)

type result struct {
	kind resultKind
	err  error
	prev dedup.Previous
}

// handle takes one delivery to its end: acked after a commit or a dead
// letter, or abandoned unacked when its context ends. When suspect is set,
// the message may be a redelivery after a crash and its attempt is counted
// durably first. It reports whether the message's id was claimed as new.
func (e *engine) handle(work context.Context, dv Delivery, suspect bool) (claimed bool) {
	e.sem <- struct{}{}
	defer func() { <-e.sem }()

	ctx, cancel := context.WithCancel(work)
	stop := context.AfterFunc(dv.Context(), cancel)
	defer func() { stop(); cancel() }()
	e.tel.inflight.Add(ctx, 1, e.tel.baseOpt)
	defer e.tel.inflight.Add(ctx, -1, e.tel.baseOpt)

	j, dl := e.newJob(ctx, dv)
	defer j.span.End()
	if dl != nil {
		e.deadLetter(j.ctx, j, dl)
		return false
	}
	return e.handleJob(j, suspect)
}

// handleJob takes a prepared job to its end; see handle.
func (e *engine) handleJob(j *job, suspect bool) (claimed bool) {
	if suspect {
		// Messages that may have crashed a process are handled one at a
		// time, so that a crash is counted against the one message in
		// flight and not against innocent neighbours.
		e.suspectMu.Lock()
		defer e.suspectMu.Unlock()
		if !e.recordCrashAttempt(j.ctx, j) {
			return false
		}
		if j.crashes > e.cfg.MaxCrashAttempts {
			e.deadLetter(j.ctx, j, &DeadLetter{Kind: KindCrashLoop, Attempts: j.crashes - 1,
				Error: fmt.Sprintf("handling was cut short %d times (process crash or stall)", j.crashes-1)})
			return false
		}
	}
	return e.attempts(j.ctx, j)
}

// newJob starts the message's span and prepares it for its handler: event
// id, type, decoded payload, fingerprint. A non-nil DeadLetter says why the
// message cannot be handled.
func (e *engine) newJob(ctx context.Context, dv Delivery) (*job, *DeadLetter) {
	m := dv.Message()
	ctx, span := e.tel.startSpan(ctx, m)
	j := &job{d: dv, m: m, span: span, ctx: ctx}
	var kind ErrorKind
	var err error
	if j.idt, kind, err = e.cfg.identify(m); err == nil {
		span.SetAttributes(attribute.String("messaging.message.id", j.idt.id), attribute.String("once.event.type", j.idt.typ))
		var p prepared
		p, kind, err = e.prepare(m, j.idt, e.cfg.Decoder)
		j.call, j.event = p.call, p.event
	}
	if err != nil {
		return j, &DeadLetter{Kind: kind, Error: err.Error()}
	}
	if e.cfg.Fingerprint != nil {
		j.fp = e.cfg.Fingerprint(m)
	}
	return j, nil
}

// attempts runs the message's transaction until it commits, is found a
// duplicate, is dead-lettered or is abandoned.
func (e *engine) attempts(ctx context.Context, j *job) (claimed bool) {
	return e.attemptsFrom(ctx, j, 1)
}

// attemptsFrom is attempts starting at the given attempt number.
func (e *engine) attemptsFrom(ctx context.Context, j *job, attempt int) (claimed bool) {
	infraWait := e.cfg.InfraBackoff.Initial
	for {
		r := e.attempt(ctx, j, attempt+max(j.crashes-1, 0))
		if r.kind != resInfraErr {
			infraWait = e.cfg.InfraBackoff.Initial
		}
		switch r.kind {
		case resHandled, resSkipped:
			e.settle(ctx, j, map[resultKind]string{resHandled: "handled", resSkipped: "skipped"}[r.kind])
			return true
		case resDuplicate:
			e.settle(ctx, j, "duplicate")
			return false
		case resConflict:
			e.conflict(ctx, j, r.prev)
			return false
		case resAbandoned:
			e.abandon(j)
			return false
		case resInfraErr:
			e.stats.infraErrors.Add(1)
			e.cfg.Logger.Warn("once: infrastructure failure; retrying the message", "consumer", e.cfg.Name,
				"event_id", j.idt.id, "error", r.err, "backoff", infraWait)
			if !sleep(ctx, jitter(infraWait)) {
				e.abandon(j)
				return false
			}
			e.stats.retries.Add(1)
			e.tel.retry(ctx, "infrastructure")
			infraWait = min(infraWait*2, e.cfg.InfraBackoff.Max)
		case resHandlerErr:
			if !e.retryHandler(ctx, j, r.err, attempt) {
				return false
			}
			attempt++
		}
	}
}

// retryHandler waits before the next attempt, or dead-letters the message
// when the error is permanent or the attempts are spent. It reports whether
// to try again.
func (e *engine) retryHandler(ctx context.Context, j *job, err error, attempt int) bool {
	var perm *PermanentError
	if errors.As(err, &perm) || attempt >= e.cfg.Retry.MaxAttempts {
		dl := &DeadLetter{Kind: KindHandler, Error: err.Error(), Attempts: attempt + max(j.crashes-1, 0)}
		var p *PanicError
		if errors.As(err, &p) {
			dl.Kind, dl.Stack = KindPanic, p.Stack
		}
		e.deadLetter(ctx, j, dl)
		return false
	}
	wait := retryDelay(e.cfg.Retry, attempt)
	var ra *RetryAfterError
	if errors.As(err, &ra) {
		wait = ra.Delay
	}
	e.cfg.Logger.Debug("once: handler failed; retrying", "consumer", e.cfg.Name, "event_id", j.idt.id,
		"attempt", attempt, "error", err, "backoff", wait)
	if !sleep(ctx, wait) {
		e.abandon(j)
		return false
	}
	e.stats.retries.Add(1)
	e.tel.retry(ctx, "handler")
	return true
}

// attempt runs one transaction: claim, handler, commit.
func (e *engine) attempt(ctx context.Context, j *job, attempt int) result {
	if ctx.Err() != nil {
		return result{kind: resAbandoned}
	}
	actx := ctx
	if e.cfg.HandlerTimeout > 0 {
		var cancel context.CancelFunc
		actx, cancel = context.WithTimeout(ctx, e.cfg.HandlerTimeout)
		defer cancel()
	}
	r := e.transaction(actx, j, attempt)
	switch {
	case ctx.Err() != nil && (r.kind == resInfraErr || r.kind == resHandlerErr):
		j.stalled = j.d.Context().Err() == nil
		return result{kind: resAbandoned}
	case actx.Err() != nil && (r.kind == resInfraErr || r.kind == resHandlerErr):
		// Our own HandlerTimeout, not the database: the handler is slow.
		return result{kind: resHandlerErr, err: fmt.Errorf("attempt exceeded HandlerTimeout (%s): %w", e.cfg.HandlerTimeout, r.err)}
	}
	return r
}

func (e *engine) transaction(ctx context.Context, j *job, attempt int) result {
	// BEGIN and the claim share one round trip.
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	pending := e.cfg.Store.QueueClaim(b, j.claim(e.cfg.Name))
	tx, err := e.begin(ctx, b)
	if tx != nil {
		defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after Commit
	}
	if err != nil {
		return result{kind: resInfraErr, err: err}
	}
	res, err := pending.Result(ctx, tx)
	if err != nil {
		return result{kind: resInfraErr, err: err}
	}
	switch res.Outcome {
	case dedup.Duplicate:
		return result{kind: resDuplicate}
	case dedup.Conflict:
		return result{kind: resConflict, prev: res.Previous}
	}
	crashPoint("after-claim")
	if j.crashes > 0 {
		// Forget the attempt count with the effects: both commit or neither.
		if err := e.cfg.Store.ClearAttempts(ctx, tx, e.cfg.Name, j.idt.id); err != nil {
			return result{kind: resInfraErr, err: err}
		}
	}
	kind := resSkipped
	if j.call != nil {
		kind = resHandled
		start := time.Now()
		qtx := newQueueTx(tx)
		err = qtx.settle(ctx, safeCall(ctx, qtx, j.call, attempt))
		e.tel.since(ctx, e.tel.handlerDur, start)
		if err != nil {
			if databaseFailure(tx, err) {
				return result{kind: resInfraErr, err: err}
			}
			return result{kind: resHandlerErr, err: err}
		}
		crashPoint("after-handler")
	}
	start := time.Now()
	err = tx.Commit(ctx)
	e.tel.since(ctx, e.tel.commitDur, start)
	switch {
	case errors.Is(err, pgx.ErrTxCommitRollback):
		return result{kind: resHandlerErr, err: errors.New("the transaction was aborted by a failed statement whose error the handler did not return")}
	case errors.Is(err, pgx.ErrTxClosed):
		return result{kind: resHandlerErr, err: Permanent(errors.New("the handler committed or rolled back the consumer's transaction"))}
	}
	if err != nil {
		// The commit may or may not have happened; a retry finds out: a
		// duplicate if it did.
		return result{kind: resInfraErr, err: fmt.Errorf("commit: %w", err)}
	}
	crashPoint("after-commit")
	return result{kind: kind}
}

// begin sends b, which begins a transaction, and returns the transaction
// once b's results are read. The transaction is returned, to be rolled
// back, even when err is not nil.
func (e *engine) begin(ctx context.Context, b *pgx.Batch) (pgx.Tx, error) {
	br := e.pool.SendBatch(ctx, b)
	return br.Tx(), br.Close()
}

// claim is the dedup claim of j's id.
func (j *job) claim(consumer string) dedup.Claim {
	return dedup.Claim{Consumer: consumer, EventID: j.idt.id, Fingerprint: j.fp,
		Source: j.m.Topic, Partition: j.m.Partition, Offset: j.m.Offset}
}

func safeCall(ctx context.Context, tx pgx.Tx, c call, attempt int) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = &PanicError{Value: r, Stack: string(debug.Stack())}
		}
	}()
	return c(ctx, tx, attempt)
}

// recordCrashAttempt counts an attempt durably before a message that may
// be a redelivery is handled. It reports false when the message was
// abandoned meanwhile.
func (e *engine) recordCrashAttempt(ctx context.Context, j *job) bool {
	wait := e.cfg.InfraBackoff.Initial
	for {
		n, err := e.cfg.Store.RecordAttempt(ctx, e.pool, e.cfg.Name, j.idt.id)
		if err == nil {
			j.crashes = n
			return true
		}
		if ctx.Err() != nil {
			e.abandon(j)
			return false
		}
		e.stats.infraErrors.Add(1)
		e.cfg.Logger.Warn("once: infrastructure failure recording an attempt; retrying", "consumer", e.cfg.Name,
			"event_id", j.idt.id, "error", err)
		if !sleep(ctx, jitter(wait)) {
			e.abandon(j)
			return false
		}
		wait = min(wait*2, e.cfg.InfraBackoff.Max)
	}
}

func (e *engine) conflict(ctx context.Context, j *job, prev dedup.Previous) {
	if e.cfg.OnIDConflict == SkipConflicts {
		e.cfg.Logger.Warn("once: event id seen before with a different payload; skipped", "consumer", e.cfg.Name,
			"event_id", j.idt.id, "processed_at", prev.ProcessedAt)
		e.settle(ctx, j, "skipped")
		return
	}
	e.deadLetter(ctx, j, &DeadLetter{Kind: KindIDConflict,
		Error: "event id was processed before with a different payload fingerprint",
		Extra: map[string]string{
			HeaderFingerprint:         hex.EncodeToString(j.fp),
			HeaderOriginalFingerprint: hex.EncodeToString(prev.Fingerprint),
			HeaderOriginalProcessedAt: prev.ProcessedAt.UTC().Format(time.RFC3339Nano),
		}})
}

// deadLetter writes the message to the dead-letter destination, retrying
// until the broker confirms it, then acks it.
func (e *engine) deadLetter(ctx context.Context, j *job, dl *DeadLetter) {
	dl.Consumer, dl.EventID, dl.EventType = e.cfg.Name, j.idt.id, j.idt.typ
	dl.FailedAt = time.Now()
	dl.TraceParent = e.tel.traceParent(ctx)
	wait := e.cfg.InfraBackoff.Initial
	for {
		err := j.d.DeadLetter(ctx, dl)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			e.abandon(j)
			return
		}
		e.stats.infraErrors.Add(1)
		e.cfg.Logger.Warn("once: dead-letter write failed; retrying, the message stays unacked", "consumer", e.cfg.Name,
			"event_id", dl.EventID, "error", err)
		if !sleep(ctx, jitter(wait)) {
			e.abandon(j)
			return
		}
		wait = min(wait*2, e.cfg.InfraBackoff.Max)
	}
	crashPoint("after-dead-letter")
	e.stats.deadLettered.Add(1)
	e.tel.deadLetter(ctx, j.span, dl.Kind, dl.Error)
	e.cfg.Logger.Warn("once: message dead-lettered", "consumer", e.cfg.Name, "event_id", dl.EventID,
		"event_type", dl.EventType, "kind", dl.Kind, "error", dl.Error, "topic", j.m.Topic)
	if j.crashes > 0 {
		if err := e.cfg.Store.ClearAttempts(ctx, e.pool, e.cfg.Name, j.idt.id); err != nil {
			e.cfg.Logger.Debug("once: clearing attempt count", "error", err)
		}
	}
	e.ack(ctx, j, "dead_lettered")
}

func (e *engine) settle(ctx context.Context, j *job, outcome string) {
	switch outcome {
	case "handled":
		e.stats.handled.Add(1)
	case "duplicate":
		e.stats.duplicates.Add(1)
	case "skipped":
		e.stats.skipped.Add(1)
	}
	e.ack(ctx, j, outcome)
}

func (e *engine) ack(ctx context.Context, j *job, outcome string) {
	e.tel.outcome(ctx, j.span, outcome)
	if err := j.d.Ack(ctx); err != nil {
		// The effect is committed; the broker will redeliver and the
		// claim will find a duplicate.
		e.cfg.Logger.Warn("once: ack failed; the message will be redelivered and skipped", "consumer", e.cfg.Name,
			"event_id", j.idt.id, "error", err)
	}
}

func (e *engine) abandon(j *job) {
	j.span.SetAttributes(attribute.String("once.outcome", "abandoned"))
	e.cfg.Logger.Debug("once: message abandoned unacked", "consumer", e.cfg.Name, "event_id", j.idt.id)
	if j.crashes > 0 && !j.stalled {
		// Not a crash: the delivery was lost (channel closed, partition
		// revoked) or the consumer stopped between attempts. Take back the
		// attempt counted for it, so that infrastructure failures never add
		// up to a crash loop. Best effort: a count left behind errs on the
		// side of dead-lettering later.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := e.cfg.Store.UnrecordAttempt(ctx, e.pool, e.cfg.Name, j.idt.id); err != nil {
			e.cfg.Logger.Debug("once: taking back an attempt count", "consumer", e.cfg.Name, "event_id", j.idt.id, "error", err)
		}
		j.crashes = 0
	}
}

// retention deletes old processed-event rows every RetentionInterval.
func (e *engine) retention(ctx context.Context) {
	t := time.NewTicker(e.cfg.RetentionInterval)
	defer t.Stop()
	for {
		n, err := e.cfg.Store.DeleteOlderThan(ctx, e.pool, e.cfg.Name, time.Now().Add(-e.cfg.RetentionMaxAge), 1000)
		switch {
		case err != nil && ctx.Err() == nil:
			e.cfg.Logger.Warn("once: retention failed", "consumer", e.cfg.Name, "error", err)
		case n > 0:
			e.cfg.Logger.Info("once: retention removed processed events", "consumer", e.cfg.Name, "rows", n)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// retryDelay is the wait after failed attempt n (1-based).
func retryDelay(p RetryPolicy, n int) time.Duration {
	d := p.InitialBackoff
	for i := 1; i < n && d < p.MaxBackoff; i++ {
		d *= 2
	}
	return jitter(min(d, p.MaxBackoff))
}

// jitter spreads d by ±20% so that many consumers do not retry in step.
func jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d*8/10 + rand.N(d*4/10+1)
}

// sleep waits d or until ctx is done; it reports whether d elapsed.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func waitTimeout(wg *sync.WaitGroup, d time.Duration) bool {
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}
