package consumer

import (
	"context"
	"errors"
	"runtime/debug"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceco/once/dedup"
)

// collect returns first plus the deliveries already waiting in ch, up to
// Config.BatchSize, waiting at most Config.BatchLinger for more. With no
// linger a batch is whatever accumulated while the previous one was being
// handled: one message under light load, full batches under heavy load.
func (e *engine) collect(first Delivery, ch <-chan Delivery) []Delivery {
	batch := []Delivery{first}
	var linger <-chan time.Time
	if e.cfg.BatchLinger > 0 && e.cfg.BatchSize > 1 {
		t := time.NewTimer(e.cfg.BatchLinger)
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
func (e *engine) handleBatch(work context.Context, dvs []Delivery) {
	if len(dvs) == 1 {
		e.handle(work, dvs[0], false)
		return
	}
	e.sem <- struct{}{}
	defer func() { <-e.sem }()

	// The deliveries of a batch share their fate: if any can no longer be
	// acked (revoked partition, closed channel), the batch is abandoned.
	ctx, cancel := context.WithCancel(work)
	defer cancel()
	for _, dv := range dvs {
		stop := context.AfterFunc(dv.Context(), cancel)
		defer stop()
	}
	e.tel.inflight.Add(ctx, int64(len(dvs)), metric.WithAttributeSet(e.tel.base))
	defer e.tel.inflight.Add(ctx, -int64(len(dvs)), metric.WithAttributeSet(e.tel.base))

	jobs := make([]*job, 0, len(dvs))
	for _, dv := range dvs {
		j, dl := e.newJob(ctx, dv)
		defer j.span.End()
		if dl == nil {
			jobs = append(jobs, j)
			continue
		}
		e.runBatch(ctx, jobs)
		jobs = jobs[:0]
		if ctx.Err() != nil {
			return // abandoned: nothing after this is acked
		}
		e.deadLetter(j.ctx, j, dl)
	}
	e.runBatch(ctx, jobs)
}

// batchResult is the outcome of one batch transaction.
type batchResult struct {
	claims []dedup.Result
	// failed is the index of the job whose handler failed, or -1.
	failed int
	err    error
	// infra: an infrastructure failure; retry the whole batch.
	infra bool
	// split: the failure cannot be pinned on one job; handle each alone.
	split bool
	// abandoned: the consumer began stopping during the batch; it was
	// rolled back and none of it is acked.
	abandoned bool
}

// runBatch takes jobs to their end. When a handler fails, the transaction
// is rolled back and the batch split: the jobs before the failing one run
// again as a batch, the failing one runs alone under the retry policy, the
// rest continue as a batch. Order is kept, and a failure costs a re-run of
// the jobs before it instead of a savepoint round trip for every message.
func (e *engine) runBatch(ctx context.Context, jobs []*job) {
	infraWait := e.cfg.InfraBackoff.Initial
	for len(jobs) > 0 {
		if ctx.Err() != nil {
			return
		}
		if len(jobs) == 1 {
			e.attempts(jobs[0].ctx, jobs[0])
			return
		}
		r := e.batchTransaction(ctx, jobs)
		switch {
		case r.infra:
			if ctx.Err() != nil {
				return
			}
			e.stats.infraErrors.Add(1)
			e.cfg.Logger.Warn("once: infrastructure failure; retrying the batch", "consumer", e.cfg.Name,
				"messages", len(jobs), "error", r.err, "backoff", infraWait)
			if !sleep(ctx, jitter(infraWait)) {
				return
			}
			e.stats.retries.Add(1)
			e.tel.retry(ctx, "infrastructure")
			infraWait = min(infraWait*2, e.cfg.InfraBackoff.Max)
		case r.split:
			for _, j := range jobs {
				e.attempts(j.ctx, j)
			}
			return
		case r.failed >= 0:
			e.cfg.Logger.Debug("once: handler failed in a batch; splitting it", "consumer", e.cfg.Name,
				"event_id", jobs[r.failed].idt.id, "error", r.err)
			e.runBatch(ctx, jobs[:r.failed])
			if ctx.Err() != nil || e.stopping.Load() {
				return
			}
			// The failure in the batch was the job's first attempt.
			if j := jobs[r.failed]; e.retryHandler(j.ctx, j, r.err, 1) {
				e.attemptsFrom(j.ctx, j, 2)
			}
			jobs = jobs[r.failed+1:]
		case r.abandoned:
			for _, j := range jobs {
				e.abandon(j)
			}
			return
		default:
			e.settleBatch(jobs, r.claims)
			return
		}
	}
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
		return batchResult{split: true, failed: -1}
	}
	return r
}

func (e *engine) runBatchTx(ctx context.Context, jobs []*job) batchResult {
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		return batchResult{infra: true, err: err, failed: -1}
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after Commit

	claims := make([]dedup.Claim, len(jobs))
	for i, j := range jobs {
		claims[i] = dedup.Claim{Consumer: e.cfg.Name, EventID: j.idt.id, Fingerprint: j.fp,
			Source: j.m.Topic, Partition: j.m.Partition, Offset: j.m.Offset}
	}
	res, err := e.cfg.Store.ClaimBatch(ctx, tx, claims)
	if err != nil {
		return batchResult{infra: true, err: err, failed: -1}
	}
	if r, stop := e.runHandlers(ctx, tx, jobs, res); stop {
		return r
	}
	start := time.Now()
	err = tx.Commit(ctx)
	e.tel.since(ctx, e.tel.commitDur, start)
	e.tel.batchSize.Record(ctx, int64(len(jobs)), metric.WithAttributeSet(e.tel.base))
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
		err := safeBatchCall(ctx, tx, e.batchCall, claimed)
		e.tel.since(ctx, e.tel.handlerDur, start)
		switch {
		case err == nil:
			return batchResult{}, false
		case databaseFailure(tx, err) || ctx.Err() != nil:
			return batchResult{infra: true, err: err, failed: -1}, true
		}
		return batchResult{split: true, err: err, failed: -1}, true
	}
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
		err := safeCall(mergeCancel(j.ctx, ctx), tx, j.call, 1)
		e.tel.since(ctx, e.tel.handlerDur, start)
		if err == nil {
			continue
		}
		if databaseFailure(tx, err) || ctx.Err() != nil {
			return batchResult{infra: true, err: err, failed: -1}, true
		}
		return batchResult{failed: i, err: err}, true
	}
	return batchResult{}, false
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
