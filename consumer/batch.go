package consumer

import (
	"context"
	"errors"
	"runtime/debug"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/onceco/once/dedup"
)

// linger is how long a worker waits for a batch to fill: Config.
// BatchLinger, or none when batches are off.
func (e *engine) linger() time.Duration {
	if e.cfg.BatchSize <= 1 {
		return 0
	}
	return e.cfg.BatchLinger
}

// collect returns first plus the deliveries already waiting in ch, up to
// Config.BatchSize, waiting at most Config.BatchLinger for more. With no
// linger a batch is whatever accumulated while the previous one was being
// handled: one message under light load, full batches under heavy load.
func (e *engine) collect(first Delivery, ch <-chan Delivery) []Delivery {
	batch := []Delivery{first}
	var linger <-chan time.Time
	if d := e.linger(); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		linger = t.C
	}
	for len(batch) < e.cfg.BatchSize {
		if linger == nil {
			select {
			case dv, ok := <-ch:
				if !ok {
					return batch
				}
				batch = append(batch, dv)
				continue
			default:
				return batch
			}
		}
		select {
		case dv, ok := <-ch:
			if !ok {
				return batch
			}
			batch = append(batch, dv)
		case <-linger:
			return batch
		}
	}
	return batch
}

// handleBatch handles deliveries in one transaction: one statement claims
// every id, the handlers run in turn, one commit, then the acks in order.
// A message that cannot be prepared is dead-lettered in its place in the
// order, between the batches before and after it.
//
// With guard set (the first messages of a stream assignment, see
// orderedWorker), the batch's runs go through runGuarded; it returns how
// many new messages were handled under that guard.
func (e *engine) handleBatch(work context.Context, dvs []Delivery, guard bool) (guarded int) {
	if len(dvs) == 1 && !guard {
		e.handle(work, dvs[0], false)
		return 0
	}
	e.sem <- struct{}{}
	defer func() { <-e.sem }()

	// The deliveries of a batch share their fate: if any can no longer be
	// acked (revoked partition, closed channel), the batch is abandoned.
	ctx, cancel := context.WithCancel(work)
	defer cancel()
	var watched context.Context
	for _, dv := range dvs {
		// Deliveries of one assignment or channel share their context:
		// watch each distinct one once.
		if c := dv.Context(); c != watched {
			watched = c
			stop := context.AfterFunc(c, cancel)
			defer stop()
		}
	}
	e.tel.inflight.Add(ctx, int64(len(dvs)), e.tel.baseOpt)
	defer e.tel.inflight.Add(ctx, -int64(len(dvs)), e.tel.baseOpt)

	run := func(jobs []*job) {
		if guard {
			guarded += e.runGuarded(ctx, jobs)
		} else {
			e.runBatch(ctx, jobs)
		}
	}
	jobs := make([]*job, 0, len(dvs))
	for _, dv := range dvs {
		j, dl := e.newJob(ctx, dv)
		defer j.span.End()
		if dl == nil {
			jobs = append(jobs, j)
			continue
		}
		run(jobs)
		jobs = jobs[:0]
		if ctx.Err() != nil {
			return guarded // abandoned: nothing after this is acked
		}
		e.deadLetter(j.ctx, j, dl)
	}
	run(jobs)
	return guarded
}

// runGuarded runs jobs that may include the one a previous owner of the
// stream was handling when it died. If any of them has a durable attempt
// count already (a process died with it in flight), they are handled one
// at a time, each counting its own attempts, so that the one that kills
// the process is dead-lettered after Config.MaxCrashAttempts and the others
// are not charged for it. Otherwise one statement counts an attempt for
// each new id, and the batch runs as usual, clearing the counts in its
// transaction. It returns how many new messages it handled.
func (e *engine) runGuarded(ctx context.Context, jobs []*job) int {
	if len(jobs) == 0 {
		return 0
	}
	ids := make([]string, len(jobs))
	for i, j := range jobs {
		ids[i] = j.idt.id
	}
	counts, ok := e.attemptCounts(ctx, func() (map[string]int, error) {
		return e.cfg.Store.Attempts(ctx, e.pool, e.cfg.Name, ids)
	})
	if !ok {
		return 0
	}
	if len(counts) > 0 {
		n := 0
		for _, j := range jobs {
			if ctx.Err() != nil {
				break
			}
			if e.handleJob(j, true) {
				n++
			}
		}
		return n
	}
	if counts, ok = e.attemptCounts(ctx, func() (map[string]int, error) {
		return e.cfg.Store.RecordAttempts(ctx, e.pool, e.cfg.Name, ids)
	}); !ok {
		return 0
	}
	for _, j := range jobs {
		j.crashes = counts[j.idt.id]
	}
	e.runBatch(ctx, jobs)
	return len(counts)
}

// attemptCounts runs an attempt-count statement, retrying infrastructure
// failures; it reports false when ctx ended first.
func (e *engine) attemptCounts(ctx context.Context, f func() (map[string]int, error)) (map[string]int, bool) {
	wait := e.cfg.InfraBackoff.Initial
	for {
		counts, err := f()
		if err == nil {
			return counts, true
		}
		if ctx.Err() != nil {
			return nil, false
		}
		e.stats.infraErrors.Add(1)
		e.cfg.Logger.Warn("once: infrastructure failure counting attempts; retrying", "consumer", e.cfg.Name, "error", err)
		if !sleep(ctx, jitter(wait)) {
			return nil, false
		}
		wait = min(wait*2, e.cfg.InfraBackoff.Max)
	}
}

// batchResult is the outcome of one batch transaction.
type batchResult struct {
	claims []dedup.Result
	// failed is the index of the job whose handler failed, or -1.
	failed int
	err    error
	// infra: an infrastructure failure; retry the whole batch.
	infra bool
	// split: the failure cannot be pinned on one job; halve the batch.
	split bool
	// alone: the batch exceeded HandlerTimeout; handle each job alone, so
	// that each meets the timeout by itself.
	alone bool
	// abandoned: the consumer began stopping during the batch; it was
	// rolled back and none of it is acked.
	abandoned bool
}

// runBatch takes jobs to their end. When a handler fails, the transaction
// is rolled back and the batch split: the jobs before the failing one run
// again as a batch, the failing one runs alone under the retry policy, the
// rest continue as a batch. Order is kept, and a failure costs a re-run of
// the jobs before it instead of a savepoint round trip for every message.
// A failure that names no job (a BatchHandler's error) halves the batch
// until it does.
func (e *engine) runBatch(ctx context.Context, jobs []*job) {
	for _, j := range e.runBatchJobs(ctx, jobs) {
		e.abandon(j)
	}
}

// runBatchJobs is runBatch; it returns the jobs it left unsettled because
// ctx ended or the consumer is stopping.
func (e *engine) runBatchJobs(ctx context.Context, jobs []*job) (left []*job) {
	infraWait := e.cfg.InfraBackoff.Initial
	for len(jobs) > 0 {
		if ctx.Err() != nil {
			return jobs
		}
		if len(jobs) == 1 {
			e.attempts(jobs[0].ctx, jobs[0])
			return nil
		}
		r := e.batchTransaction(ctx, jobs)
		switch {
		case r.infra:
			if ctx.Err() != nil {
				// Cut short while running: by a lost delivery, or by the
				// shutdown deadline (a stall, see job.stalled).
				for _, j := range jobs {
					j.stalled = j.d.Context().Err() == nil
				}
				return jobs
			}
			e.stats.infraErrors.Add(1)
			e.cfg.Logger.Warn("once: infrastructure failure; retrying the batch", "consumer", e.cfg.Name,
				"messages", len(jobs), "error", r.err, "backoff", infraWait)
			if !sleep(ctx, jitter(infraWait)) {
				return jobs
			}
			e.stats.retries.Add(1)
			e.tel.retry(ctx, "infrastructure")
			infraWait = min(infraWait*2, e.cfg.InfraBackoff.Max)
		case r.alone:
			for _, j := range jobs {
				e.attempts(j.ctx, j)
			}
			return nil
		case r.split:
			// The failure cannot be pinned on one job (a BatchHandler's
			// error, a queued statement that could not be prepared, a
			// commit refused after a swallowed error): halve the batch
			// until it can. One bad event in n costs about 2·log2(n) batch
			// transactions instead of n single ones, and order is kept.
			half := len(jobs) / 2
			if left := e.runBatchJobs(ctx, jobs[:half]); len(left) > 0 || ctx.Err() != nil || e.stopping.Load() {
				return append(left, jobs[half:]...)
			}
			jobs = jobs[half:]
		case r.failed >= 0:
			e.cfg.Logger.Debug("once: handler failed in a batch; splitting it", "consumer", e.cfg.Name,
				"event_id", jobs[r.failed].idt.id, "error", r.err)
			if left := e.runBatchJobs(ctx, jobs[:r.failed]); len(left) > 0 || ctx.Err() != nil || e.stopping.Load() {
				return append(left, jobs[r.failed:]...)
			}
			// The failure in the batch was the job's first attempt.
			if j := jobs[r.failed]; e.retryHandler(j.ctx, j, r.err, 1) {
				e.attemptsFrom(j.ctx, j, 2)
			}
			jobs = jobs[r.failed+1:]
		case r.abandoned:
			return jobs
		default:
			e.settleBatch(jobs, r.claims)
			return nil
		}
	}
	return nil
}

func (e *engine) batchTransaction(ctx context.Context, jobs []*job) batchResult {
	bctx := ctx
	if e.cfg.HandlerTimeout > 0 {
		var cancel context.CancelFunc
		bctx, cancel = context.WithTimeout(ctx, e.cfg.HandlerTimeout)
		defer cancel()
	}
	r := e.runBatchTx(bctx, jobs)
	if r.infra && bctx.Err() != nil && ctx.Err() == nil {
		// Our own HandlerTimeout: let each message meet it alone.
		return batchResult{alone: true, failed: -1}
	}
	return r
}

func (e *engine) runBatchTx(ctx context.Context, jobs []*job) batchResult {
	claims := make([]dedup.Claim, len(jobs))
	for i, j := range jobs {
		claims[i] = j.claim(e.cfg.Name)
	}
	// BEGIN and the claim share one round trip.
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	pending, err := e.cfg.Store.QueueClaimBatch(b, claims)
	if err != nil {
		return batchResult{infra: true, err: err, failed: -1}
	}
	tx, err := e.begin(ctx, b)
	if tx != nil {
		defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after Commit
	}
	if err != nil {
		return batchResult{infra: true, err: err, failed: -1}
	}
	res, err := pending.Results(ctx, tx)
	if err != nil {
		return batchResult{infra: true, err: err, failed: -1}
	}
	if err := e.clearCrashCounts(ctx, tx, jobs); err != nil {
		return batchResult{infra: true, err: err, failed: -1}
	}
	crashPoint("after-claim")
	if r, stop := e.runHandlers(ctx, tx, jobs, res); stop {
		return r
	}
	crashPoint("after-handler")
	start := time.Now()
	err = tx.Commit(ctx)
	e.tel.since(ctx, e.tel.commitDur, start)
	e.tel.batchSize.Record(ctx, int64(len(jobs)), e.tel.baseOpt)
	switch {
	case errors.Is(err, pgx.ErrTxCommitRollback), errors.Is(err, pgx.ErrTxClosed):
		return batchResult{split: true, err: err, failed: -1}
	case err != nil:
		return batchResult{infra: true, err: err, failed: -1}
	}
	crashPoint("after-commit")
	return batchResult{claims: res, failed: -1}
}

// runHandlers runs the handlers of the claimed jobs in tx: one call of the
// BatchHandler, or each Handler in turn. It reports whether the batch must
// stop short of its commit, and why.
func (e *engine) runHandlers(ctx context.Context, tx pgx.Tx, jobs []*job, res []dedup.Result) (batchResult, bool) {
	if e.batchCall != nil {
		claimed := make([]*job, 0, len(jobs))
		for i, j := range jobs {
			if res[i].Outcome == dedup.Claimed {
				claimed = append(claimed, j)
			}
		}
		if len(claimed) == 0 {
			return batchResult{}, false
		}
		start := time.Now()
		qtx := newQueueTx(tx)
		qtx.owner = -1
		err := qtx.settle(ctx, safeBatchCall(ctx, qtx, e.batchCall, claimed))
		e.tel.since(ctx, e.tel.handlerDur, start)
		if err != nil {
			// A BatchHandler's error names no event.
			return e.handlerFailure(ctx, tx, -1, err), true
		}
		return batchResult{}, false
	}
	qtx := newQueueTx(tx)
	for i, j := range jobs {
		if i > 0 && e.stopping.Load() {
			// Shutting down: roll back rather than wait for the whole
			// batch. (Committing the handled part would commit the claims
			// of the unhandled part too.)
			return batchResult{abandoned: true, failed: -1}, true
		}
		if res[i].Outcome != dedup.Claimed || j.call == nil {
			continue
		}
		if i == len(jobs)/2 {
			crashPoint("mid-batch")
		}
		start := time.Now()
		qtx.owner = i
		err := safeCall(mergeCancel(j.ctx, ctx), qtx, j.call, 1)
		e.tel.since(ctx, e.tel.handlerDur, start)
		if f := qtx.failed; f != nil {
			// A statement queued by this or an earlier event failed.
			return e.handlerFailure(ctx, tx, f.owner, f.err), true
		}
		if err != nil {
			return e.handlerFailure(ctx, tx, i, err), true
		}
	}
	if f := qtx.flush(ctx); f != nil {
		return e.handlerFailure(ctx, tx, f.owner, f.err), true
	}
	return batchResult{}, false
}

// handlerFailure is the batch's result when the handler of jobs[i] failed
// with err (its own error, or that of a statement it queued); i < 0 when
// the failure names no job.
func (e *engine) handlerFailure(ctx context.Context, tx pgx.Tx, i int, err error) batchResult {
	switch {
	case databaseFailure(tx, err) || ctx.Err() != nil:
		return batchResult{infra: true, err: err, failed: -1}
	case i < 0:
		return batchResult{split: true, err: err, failed: -1}
	}
	return batchResult{failed: i, err: err}
}

func safeBatchCall(ctx context.Context, tx pgx.Tx, c func(context.Context, pgx.Tx, []*job) error, jobs []*job) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = &PanicError{Value: r, Stack: string(debug.Stack())}
		}
	}()
	return c(ctx, tx, jobs)
}

// mergeCancel returns jobCtx (which carries the job's span) when it is
// already bounded by ctx, as it is when both derive from the batch context.
// A HandlerTimeout on the batch context is carried over.
func mergeCancel(jobCtx, ctx context.Context) context.Context {
	if _, ok := ctx.Deadline(); !ok {
		return jobCtx
	}
	merged, cancel := context.WithCancel(jobCtx)
	context.AfterFunc(ctx, cancel)
	return merged
}

// settleBatch acks a committed batch's messages in order.
func (e *engine) settleBatch(jobs []*job, claims []dedup.Result) {
	for i, j := range jobs {
		switch {
		case claims[i].Outcome == dedup.Duplicate:
			e.settle(j.ctx, j, "duplicate")
		case claims[i].Outcome == dedup.Conflict:
			e.conflict(j.ctx, j, claims[i].Previous)
		case j.call == nil:
			e.settle(j.ctx, j, "skipped")
		default:
			e.settle(j.ctx, j, "handled")
		}
	}
}

// clearCrashCounts deletes, in the batch's transaction, the attempt counts
// recorded for its jobs: they go when the effects commit.
func (e *engine) clearCrashCounts(ctx context.Context, tx pgx.Tx, jobs []*job) error {
	var ids []string
	for _, j := range jobs {
		if j.crashes > 0 {
			ids = append(ids, j.idt.id)
		}
	}
	return e.cfg.Store.ClearAttemptsBatch(ctx, tx, e.cfg.Name, ids)
}
