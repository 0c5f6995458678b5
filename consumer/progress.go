package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/dedup"
)

// A source may keep its own record of which messages are done in the
// consumer's database, in the transaction that commits their claims and
// effects: Kafka's offsets stored outside Kafka (kafka.Config's
// OffsetsInDatabase). The consumer finds the hooks by type assertion.

// ProgressRecorder is implemented by sources that record their progress in
// the consumer's transactions.
type ProgressRecorder interface {
	// BindProgress is called once by Run, after the store's tables were
	// migrated (or checked, with Config.SkipMigrate) and before the first
	// Receive. An error stops Run; so does a panic, as an error wrapping
	// ErrSourceBroken.
	BindProgress(ctx context.Context, b ProgressBinding) error
	// RecordProgress is called in the transaction of a run of deliveries of
	// one Stream, just before its COMMIT, with the deliveries the
	// transaction settles (handled, or found duplicates), in stream order.
	// Deliveries to be dead-lettered after the commit (an id conflict) are
	// left out: they are done only once their dead letter is written. An
	// error wrapping dedup.ErrFenced (another owner took the deliveries'
	// partition over) rolls the transaction back and abandons the
	// deliveries unacked, for the new owner; any other error is an
	// infrastructure failure, retried with backoff; so is a panic, taken as
	// an error wrapping ErrSourceBroken, but SourcePanicLimit panics in a
	// row for the same deliveries stop Run. It is called from many workers
	// at once, for different streams.
	RecordProgress(ctx context.Context, tx pgx.Tx, deliveries []Delivery) error
}

// ProgressBinding is what a ProgressRecorder is given at the start of Run.
type ProgressBinding struct {
	// Consumer is Config.Name: progress is recorded per consumer name.
	Consumer string
	// Pool is the consumer's pool.
	Pool *pgxpool.Pool
	// Store names the tables (Store.OffsetsTable).
	Store  *dedup.Store
	Logger *slog.Logger
	// DatabaseTimeout is Config.DatabaseTimeout: a source bounds each of
	// its own statements by it (0: no bound), so that a connection whose
	// server vanished without a word holds it no longer.
	DatabaseTimeout time.Duration
}

// PositionDeduplicated is implemented by deliveries whose source records
// their position in the consumer's transaction (ProgressRecorder) and never
// hands out again a delivery recorded done. When DeduplicatedByPosition
// returns true and the delivery's event id is its Message.FallbackID (the
// event carries no id of its own), the consumer claims no row in the
// processed-events table for it: its position deduplicates it. Events that
// carry ids are claimed as always, since the same event may come again at
// another position (a producer's retry, a re-publication).
// DeduplicatedByPosition is called once, when the delivery is received,
// like Delivery.Message: a panic in it stops Run with an error wrapping
// ErrSourceBroken.
type PositionDeduplicated interface {
	DeduplicatedByPosition() bool
}

// FirstPositionChecker is implemented by PositionDeduplicated deliveries
// whose source can tell whether the record at a fallback id's position is
// done. A redriven copy of another consumer's dead letter of a record
// without an id is identified by its first delivery's fallback id
// (HeaderRedriveFallbackID); a consumer that recorded that delivery by its
// position alone has no processed-events row to find, and asks here: a
// first position done makes the copy a duplicate. The copy of this
// consumer's own dead letter is not asked about (its first position is
// done too, dead-lettered), and is handled once under its
// processed-events row.
type FirstPositionChecker interface {
	// FirstPositionDone reports, in the consumer's transaction tx, whether
	// the record whose Message.FallbackID was fallbackID is recorded done.
	// An error rolls the transaction back and is retried with backoff as
	// an infrastructure failure; so is a panic, taken as an error wrapping
	// ErrSourceBroken, but SourcePanicLimit panics in a row for the same
	// message stop Run.
	FirstPositionDone(ctx context.Context, tx pgx.Tx, fallbackID string) (bool, error)
}

// checkFirstPositions makes a duplicate of each claimed job whose id is
// the first position of another consumer's redriven dead letter, when its
// source records that position done.
func (p *pipeline) checkFirstPositions(ctx context.Context, tx pgx.Tx, jobs []*job, res []dedup.Result) error {
	for i, j := range jobs {
		if !j.idt.firstPosition || res[i].Outcome != dedup.Claimed {
			continue
		}
		fc, ok := j.d.(FirstPositionChecker)
		if !ok || !j.byPosition {
			continue
		}
		var done bool
		err := p.watchedSourceCall(&j.watch, "Delivery.FirstPositionDone", j.m, j.idt.id, 1, func() (err error) {
			done, err = fc.FirstPositionDone(ctx, tx, j.idt.id)
			return err
		})
		if err != nil {
			return err
		}
		if done {
			res[i] = dedup.Result{Outcome: dedup.Duplicate}
		}
	}
	return nil
}

// bindProgress binds a ProgressRecorder source to the consumer.
func (p *pipeline) bindProgress(ctx context.Context) error {
	r, ok := p.src.(ProgressRecorder)
	if !ok {
		return nil
	}
	return sourceCall("BindProgress", func() error {
		return r.BindProgress(ctx, ProgressBinding{Consumer: p.cfg.Name, Pool: p.pool, Store: p.cfg.Store, Logger: p.cfg.Telemetry.Logger,
			DatabaseTimeout: max(p.cfg.DatabaseTimeout, 0)})
	})
}

// deduplicatedByPosition reports whether j needs no processed-events row.
func deduplicatedByPosition(j *job) bool {
	return j.byPosition && j.m.FallbackID != "" && j.idt.id == j.m.FallbackID
}

// anyByPosition reports whether any of jobs is deduplicated by its
// position.
func anyByPosition(jobs []*job) bool {
	for _, j := range jobs {
		if deduplicatedByPosition(j) {
			return true
		}
	}
	return false
}

// queueClaimsByPosition is queueClaims for the jobs that need a
// processed-events row; those deduplicated by their position are claimed
// without one.
func (p *pipeline) queueClaimsByPosition(b *pgx.Batch, jobs []*job) (func(context.Context, dedup.DB) ([]dedup.Result, error), error) {
	var rest []*job
	var restAt []int
	for i, j := range jobs {
		if !deduplicatedByPosition(j) {
			rest = append(rest, j)
			restAt = append(restAt, i)
		}
	}
	if len(rest) == len(jobs) {
		return p.queueClaims(b, jobs)
	}
	var claims func(context.Context, dedup.DB) ([]dedup.Result, error)
	if len(rest) > 0 {
		var err error
		if claims, err = p.queueClaims(b, rest); err != nil {
			return nil, err
		}
	}
	return func(ctx context.Context, tx dedup.DB) ([]dedup.Result, error) {
		res := make([]dedup.Result, len(jobs))
		for i := range res {
			// Deduplicated by its position: claimed without a row.
			res[i].Outcome = dedup.Claimed
		}
		if claims == nil {
			return res, nil
		}
		got, err := claims(ctx, tx)
		if err != nil {
			return nil, err
		}
		for k, i := range restAt {
			res[i] = got[k]
		}
		return res, nil
	}, nil
}

// recordProgress lets a ProgressRecorder source record the progress of
// jobs in tx. It reports whether the transaction must stop short of its
// commit, and why.
func (p *pipeline) recordProgress(ctx context.Context, tx pgx.Tx, jobs []*job, res []dedup.Result) (txResult, bool) {
	r, ok := p.src.(ProgressRecorder)
	if !ok {
		return txResult{}, false
	}
	dvs := make([]Delivery, 0, len(jobs))
	for i, j := range jobs {
		if res[i].Outcome == dedup.Conflict && p.cfg.Identify.OnConflict == DeadLetterConflicts {
			continue // done once dead-lettered
		}
		dvs = append(dvs, j.d)
	}
	if len(dvs) == 0 {
		return txResult{}, false
	}
	err := p.watchedSourceCall(new(userCall), "Source.RecordProgress", nil, "", len(dvs), func() error { return r.RecordProgress(ctx, tx, dvs) })
	switch {
	case err == nil:
		return txResult{}, false
	case errors.Is(err, dedup.ErrFenced):
		p.cfg.Telemetry.Logger.WarnContext(ctx, "once: the source's partition was taken over by another owner; rolling back and leaving its messages to it",
			"consumer", p.cfg.Name, "messages", len(jobs), "error", err)
		return txResult{outcome: txAbandoned, err: err, failed: -1}, true
	default:
		return txResult{outcome: txInfra, err: fmt.Errorf("recording the source's progress: %w", err), failed: -1}, true
	}
}
