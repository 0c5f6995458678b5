package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/onceco/once/internal/backoff"
)

// The executor drives the claim-and-run stage (transact.go) until every
// job of a run is settled: it retries infrastructure failures with
// backoff, splits a run around a failing job, and takes a failing job
// through the retry policy alone. Order is kept: the jobs before a failure
// commit (as a run of their own) before the failing job is retried, and
// the jobs after it wait.

// run takes jobs (one stream's, in order; or a channel's) to their end. A
// failure costs a re-run of the jobs before it, instead of a savepoint
// round trip for every message; a failure that names no job halves the run
// until it does.
func (p *pipeline) run(ctx context.Context, s *settler, jobs []*job) {
	infra := infraRetrier{Retrier: backoff.Retrier{Policy: p.infraPolicy()}}
	lostOnce := false
	for len(jobs) > 0 {
		if p.mustStop(ctx, s) {
			s.abandonAll(jobs)
			return
		}
		if len(jobs) == 1 {
			p.runAlone(ctx, s, jobs[0], nil)
			return
		}
		r := p.transact(ctx, jobs)
		switch r.outcome {
		case txCommitted:
			s.committed(jobs, r.claims)
			return
		case txAbandoned:
			s.abandonAll(jobs)
			return
		case txInfra:
			if !p.waitInfra(ctx, s, &infra, r.err, len(jobs)) {
				s.abandonAll(jobs)
				return
			}
			if r.lost && lostOnce {
				// The connection went with the session while the
				// handlers worked, twice: one of them may end it every
				// time (a statement that crashes the server, or is
				// killed for its memory). Each runs alone now, so that
				// one that does it again is charged alone (crashGuard).
				// Once is a restart or a failover, most likely: the
				// run is tried again as it is, at full speed.
				p.runEachAlone(ctx, s, jobs)
				return
			}
			lostOnce = lostOnce || r.lost
		case txUnpinned:
			if !p.waitAsked(ctx, s, jobs, r.err) {
				s.abandonAll(jobs)
				return
			}
			half := len(jobs) / 2
			p.run(ctx, s, jobs[:half])
			jobs = jobs[half:]
		case txFailed:
			p.cfg.Telemetry.Logger.DebugContext(jobs[r.failed].ctx, "once: handler failed in a batch; splitting it", "consumer", p.cfg.Name,
				"event_id", jobs[r.failed].idt.id, "error", r.err)
			if r.doneBefore {
				s.committed(jobs[:r.failed], r.claims[:r.failed])
			} else {
				p.run(ctx, s, jobs[:r.failed])
			}
			// The failure in the batch was the job's run.
			failing := jobs[r.failed]
			failing.runs++
			p.runAlone(ctx, s, failing, &r)
			jobs = jobs[r.failed+1:]
		}
	}
}

// runEachAlone takes jobs to their end one at a time, in order, each a
// suspect: their transaction lost its session while their handlers ran,
// twice.
func (p *pipeline) runEachAlone(ctx context.Context, s *settler, jobs []*job) {
	for _, j := range jobs {
		p.guard.suspectLost(j)
		p.runAlone(ctx, s, j, nil)
	}
}

// runAlone takes one job to its end: attempts until it commits, is found a
// duplicate, is dead-lettered or is abandoned. failed, when not nil, is the
// failure of a run the job already had (in a batch).
func (p *pipeline) runAlone(ctx context.Context, s *settler, j *job, failed *txResult) {
	infra := infraRetrier{Retrier: backoff.Retrier{Policy: p.infraPolicy()}}
	lostOnce, outOfMemoryOnce := false, false
	for {
		if failed != nil && !p.retryOrGiveUp(ctx, s, j, *failed) {
			return
		}
		failed = nil
		if p.mustStop(ctx, s) {
			s.abandon(j)
			return
		}
		r := p.transact(ctx, []*job{j})
		switch r.outcome {
		case txCommitted:
			s.committed([]*job{j}, r.claims)
			return
		case txAbandoned:
			switch {
			case errors.Is(r.err, errCrashLoop):
				s.deadLetter(j.ctx, j, crashLoop(j))
			case errors.Is(r.err, errRunsSpent):
				s.deadLetter(j.ctx, j, p.guard.runsSpent(j))
			default:
				s.abandon(j)
			}
			return
		case txInfra:
			if chargeOutOfMemory(r, &outOfMemoryOnce) {
				infra.Reset()
				j.runs++
				failed = &r
				continue
			}
			if !p.waitInfra(ctx, s, &infra, r.err, 1) {
				s.abandon(j)
				return
			}
			if r.lost && lostOnce {
				p.guard.suspectLost(j)
			}
			lostOnce = lostOnce || r.lost
		case txFailed, txUnpinned:
			infra.Reset()
			outOfMemoryOnce = false
			j.runs++
			failed = &r
		}
	}
}

// chargeOutOfMemory reports whether r, a job's run alone that failed as
// infrastructure, is charged to the job: a lock table full (53200, "out
// of shared memory", lockTableFull) that follows another one of its runs
// alone. The first is infrastructure, as the table is the whole server's
// and other sessions may have filled it for a while; met again, it is
// most likely the job's own handler asking for more than the table holds
// (PostgreSQL's hint: raise max_locks_per_transaction), which would fail
// every retry the same way and stop its stream for ever. Charged, it goes
// through the retry policy to the dead-letter queue, with its SQLSTATE.
// Any other 53200 (the server out of memory) is the server's, however
// often it comes. once records whether the job's last run alone failed
// with a full lock table.
func chargeOutOfMemory(r txResult, once *bool) bool {
	if !lockTableFull(r.err) {
		*once = false
		return false
	}
	if !*once {
		*once = true
		return false
	}
	return true
}

// retryOrGiveUp handles a failed run of j: it dead-letters j when the
// failure is permanent or the runs are spent, else waits before the next
// run. It reports whether to run again. The logs, the hook and the dead
// letter get the message's context, with its span (ctx ends with it).
func (p *pipeline) retryOrGiveUp(ctx context.Context, s *settler, j *job, r txResult) bool {
	if r.class == ClassPermanent || j.runs >= p.cfg.Retry.MaxAttempts {
		dl := handlerDeadLetter(j, r.err)
		if j.runs >= p.cfg.Retry.MaxAttempts {
			p.guard.giveUp(j, dl)
		}
		s.deadLetter(j.ctx, j, dl)
		return false
	}
	wait := p.retryPolicy().Delay(j.runs)
	var ra *RetryAfterError
	if errors.As(r.err, &ra) {
		wait = ra.delay()
	}
	p.cfg.Telemetry.Logger.DebugContext(j.ctx, "once: handler failed; retrying", "consumer", p.cfg.Name, "event_id", j.idt.id,
		"attempt", j.runs, "error", r.err, "backoff", wait)
	p.retrying(j.ctx, Retry{Reason: RetryHandler, EventID: j.idt.id, Message: j.m, Messages: 1, Err: r.err, Wait: wait})
	if !p.pause(ctx, s, wait) {
		s.abandon(j)
		return false
	}
	p.stats.retries.Add(1)
	p.tel.retry(j.ctx, "handler")
	return true
}

// decodeAgain takes j, whose Decoder, Envelope or Identify.EventID failed
// with RetryAfter (job.undecoded), through the retry policy as
// retryOrGiveUp takes a handler's RetryAfter: it waits the delay asked
// for, aside, and identifies j again, until it decodes (it reports true: j
// is to be run), fails otherwise (dead-lettered with that failure), has
// failed Retry.MaxAttempts times (dead-lettered with kind KindDecode, or
// KindMissingID for an EventID's failure), or the consumer stops
// (abandoned). Nothing of j is claimed meanwhile: the handler never ran,
// and its runs are counted apart once it does.
func (p *pipeline) decodeAgain(ctx context.Context, s *settler, j *job) bool {
	for j.undecoded != nil {
		if p.mustStop(ctx, s) {
			s.abandon(j)
			return false
		}
		err := j.undecoded
		if j.decodeFailures >= p.cfg.Retry.MaxAttempts {
			s.deadLetter(j.ctx, j, &DeadLetter{Kind: j.undecodedKind,
				Error: fmt.Sprintf("%s (%s failed %d times, Retry.MaxAttempts)", err.Error(), undecodedStep(j.undecodedKind), j.decodeFailures)})
			return false
		}
		var wait time.Duration
		var ra *RetryAfterError
		if errors.As(err, &ra) { // always: unidentified keeps only such errors
			wait = ra.delay()
		}
		// The place in its stream names the message while it has no id
		// (an Identify.EventID that asked for a retry).
		p.cfg.Telemetry.Logger.DebugContext(j.ctx, "once: identifying or decoding the event failed and asked for a retry; retrying", "consumer", p.cfg.Name,
			"event_id", j.idt.id, "stream", j.m.Stream, "topic", j.m.Topic, "partition", j.m.Partition, "offset", j.m.Offset,
			"step", undecodedStep(j.undecodedKind), "attempt", j.decodeFailures, "error", err, "backoff", wait)
		p.retrying(j.ctx, Retry{Reason: RetryDecode, EventID: j.idt.id, Message: j.m, Messages: 1, Err: err, Wait: wait})
		if !p.pause(ctx, s, wait) {
			s.abandon(j)
			return false
		}
		p.stats.retries.Add(1)
		p.tel.retry(j.ctx, "decode")
		j.undecoded = nil
		if j.failure = p.prepareJob(j); j.failure != nil {
			s.deadLetter(j.ctx, j, j.failure)
			return false
		}
	}
	return true
}

// undecodedStep names, for a dead letter's error, the step that failed
// with RetryAfter until Retry.MaxAttempts was spent (kind, its
// job.undecodedKind).
func undecodedStep(kind ErrorKind) string {
	if kind == KindMissingID {
		return "identifying the event"
	}
	return "decoding"
}

// waitAsked waits the delay of a RetryAfter that names no job (a
// BatchHandler's) before the run is halved: the handler asked for it,
// typically for a dependency that limits its callers, which halving at
// once would call again about 2·log2(len(jobs)) times in a row. It reports
// false when the consumer stops first; any other error needs no wait.
func (p *pipeline) waitAsked(ctx context.Context, s *settler, jobs []*job, err error) bool {
	var ra *RetryAfterError
	if !errors.As(err, &ra) {
		return true
	}
	p.cfg.Telemetry.Logger.DebugContext(ctx, "once: batch handler asked to retry later; waiting before halving the batch",
		"consumer", p.cfg.Name, "messages", len(jobs), "error", err, "backoff", ra.delay())
	p.retrying(ctx, Retry{Reason: RetryHandler, Messages: len(jobs), Err: err, Wait: ra.delay()})
	if !p.pause(ctx, s, ra.delay()) {
		return false
	}
	p.stats.retries.Add(1)
	p.tel.retry(ctx, "handler")
	return true
}

// handlerDeadLetter is the dead letter of a job whose handler failed for
// good with err.
func handlerDeadLetter(j *job, err error) *DeadLetter {
	dl := &DeadLetter{Kind: KindHandler, Error: err.Error(), Attempts: j.runs}
	var pe *PanicError
	var de *DecodeError
	switch {
	case errors.As(err, &pe):
		dl.Kind, dl.Stack = KindPanic, pe.stack()
	case errors.As(err, &de):
		// The handler decoded a payload of its own: the message is
		// undecodable, found where its decoder failed.
		dl.Kind = KindDecode
	}
	if code := sqlState(err); code != "" {
		dl.Extra = map[string]string{HeaderErrorSQLState: code}
	}
	return dl
}

// mustStop reports whether no new transaction may start: the consumer is
// stopping, the run's deliveries are lost, or an earlier message of the
// stream was abandoned (nothing after it may be acked).
func (p *pipeline) mustStop(ctx context.Context, s *settler) bool {
	return ctx.Err() != nil || p.stopping.Load() || s.abandoned
}

// waitInfra counts an infrastructure failure and waits before the retry;
// it reports false when the consumer stops first.
func (p *pipeline) waitInfra(ctx context.Context, s *settler, r *infraRetrier, err error, messages int) bool {
	p.stats.infraErrors.Add(1)
	if p.sourcePanicked(ctx, &r.panics, err) {
		return false
	}
	p.leaveReadOnly(ctx, err)
	p.leaveUnanswered(err)
	d := r.Delay()
	p.logInfra(ctx, "", err, d, "messages", messages)
	p.retrying(ctx, Retry{Reason: RetryInfrastructure, Messages: messages, Err: err, Wait: d})
	if !p.pause(ctx, s, d) {
		return false
	}
	p.stats.retries.Add(1)
	p.tel.retry(ctx, "infrastructure")
	return true
}

// infra runs f until it succeeds, backing off after each failure (counted
// as an infrastructure failure, and each try after one as a retry); it
// returns an error only when the consumer stops first, or when f failed
// on the source's panic SourcePanicLimit times in a row (Run then stops). It serves the
// library's own statements outside a transaction and dead-letter writes.
// waiting says, for OnRetry, which messages wait for f (EventID,
// Messages).
func (p *pipeline) infra(ctx context.Context, what string, waiting Retry, f func() error) error {
	return p.infraFor(ctx, nil, what, waiting, f)
}

// infraFor is infra for a step that settles s's messages (a dead letter's
// write): between its tries, an ordered stream's worker leaves its slot
// (pause), as between the attempts of a transaction. The other callers
// keep theirs: one may hold the crash guard's isolation, which a worker
// that took the slot meanwhile would wait for.
func (p *pipeline) infraFor(ctx context.Context, s *settler, what string, waiting Retry, f func() error) error {
	r := backoff.Retrier{Policy: p.infraPolicy()}
	panics := 0
	for {
		err := f()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		p.stats.infraErrors.Add(1)
		if p.sourcePanicked(ctx, &panics, err) {
			return err
		}
		p.leaveReadOnly(ctx, err)
		p.leaveUnanswered(err)
		d := r.Delay()
		p.logInfra(ctx, what, err, d)
		p.retrying(ctx, Retry{Reason: RetryInfrastructure, EventID: waiting.EventID, Message: waiting.Message, Messages: waiting.Messages,
			Err: fmt.Errorf("%s: %w", what, err), Wait: d})
		if !p.pause(ctx, s, d) {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return errStopping
		}
		p.stats.retries.Add(1)
		p.tel.retry(ctx, "infrastructure")
	}
}

// logInfra logs an infrastructure failure of what (empty: the
// transaction) before a retry after d: a warning, like a blip's, unless
// the database refuses the consumer's role (authentication, a privilege),
// which no retry cures until an operator fixes it and which stops every
// message meanwhile: that is logged as an error naming the refusal.
func (p *pipeline) logInfra(ctx context.Context, what string, err error, d time.Duration, args ...any) {
	if databaseRefused(err) {
		if what == "" {
			what = "its transaction"
		}
		p.cfg.Telemetry.Logger.ErrorContext(ctx, "once: the database refuses the consumer's role (authentication or a privilege) for "+
			what+"; no message is handled until that is fixed; retrying",
			append([]any{"consumer", p.cfg.Name, "error", err, "backoff", d}, args...)...)
		return
	}
	msg := "once: infrastructure failure; retrying"
	if what != "" {
		msg = "once: infrastructure failure " + what + "; retrying"
	}
	p.cfg.Telemetry.Logger.WarnContext(ctx, msg, append([]any{"consumer", p.cfg.Name, "error", err, "backoff", d}, args...)...)
}

// leaveReadOnly resets the pool when err says a transaction was read-only
// (25006): after a failover, the connections the pool keeps reach a
// server that is a standby now, or was made read-only, and would fail
// every retry the same way until the pool retired them
// (pgxpool.Config.MaxConnLifetime). The pool closes its idle connections
// at once and the others when they are released, and the retry opens a
// new one, which reaches the writable server.
func (p *pipeline) leaveReadOnly(ctx context.Context, err error) {
	if sqlState(err) != "25006" {
		return
	}
	p.cfg.Telemetry.Logger.WarnContext(ctx, "once: the database refused a write as read-only (a failover?); closing the pool's connections",
		"consumer", p.cfg.Name, "error", err)
	p.pool.Reset()
}

// errStopping ends a wait cut short by the consumer's shutdown.
var errStopping = errors.New("once: consumer stopping")

// sleep waits d, or less if ctx ends or the consumer begins stopping; it
// reports whether d elapsed with neither. Waits between attempts end at
// once on shutdown, so a message waiting to be retried is abandoned (and
// redelivered) instead of holding up the shutdown.
func (p *pipeline) sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil && !p.stopping.Load()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-p.stopped:
		return false
	case <-t.C:
		return !p.stopping.Load()
	}
}

// pause is sleep for a wait between two attempts of s's messages (s nil:
// of none), aside: the worker runs no transaction while it waits, and with
// the slot held, messages waiting for their retry (a RetryAfter of an
// hour) stopped every other message once Concurrency of them waited.
func (p *pipeline) pause(ctx context.Context, s *settler, d time.Duration) bool {
	if s == nil || d <= 0 {
		return p.sleep(ctx, d)
	}
	return p.aside(s, func() bool { return p.sleep(ctx, d) })
}

// aside runs wait, which runs no transaction, without the transaction
// slot the caller took (takeSlot), which it takes again before it
// returns, as its caller gives one back. An unordered batch's worker is
// one of Concurrency: another takes the batches that come meanwhile
// (dispatcher.spare). Nothing waits aside holding a slot (a follower
// waits for its twin aside too, settleFollowers), so a slot is held only
// by a batch running a transaction, and a batch that waits aside for a
// twin's can always get a slot back once the twin's ends.
func (p *pipeline) aside(s *settler, wait func() bool) bool {
	<-p.sem // the slot the caller took (takeSlot)
	defer func() {
		_ = p.takeSlot() // the caller releases it, as it would have
	}()
	if !s.ordered && p.spare != nil {
		defer p.spare()()
	}
	return wait()
}

func (p *pipeline) infraPolicy() backoff.Policy {
	return backoff.Policy{Initial: p.cfg.InfraBackoff.Initial, Max: p.cfg.InfraBackoff.Max}
}

func (p *pipeline) retryPolicy() backoff.Policy {
	return backoff.Policy{Initial: p.cfg.Retry.InitialBackoff, Max: p.cfg.Retry.MaxBackoff}
}
