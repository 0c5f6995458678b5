package consumer

import (
	"context"
	"encoding/hex"
	"fmt"
	"math"
	"runtime/debug"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/onceco/once/dedup"
)

// Settle is the pipeline's last stage: ack after a commit or a confirmed
// dead letter, or abandon unacked for the broker to deliver again. A
// settler serves one stream's run of deliveries and keeps the one rule
// that makes acks safe on a Kafka partition, where an ack marks every
// earlier offset done: once a message is abandoned, nothing after it is
// acked or dead-lettered, so no offset is ever marked past an unfinished
// message (at shutdown, on a revoked partition, after a lost delivery).
type settler struct {
	p *pipeline
	// abandoned: a message of this run was abandoned; every later one is.
	abandoned bool
	// ordered: s serves a stream's run; else an unordered batch's, whose
	// waits aside start a spare worker (pipeline.aside).
	ordered bool
	// claimed counts the messages whose ids were claimed as new and
	// committed.
	claimed int
	// held are messages of the stream that cannot be handled, in stream
	// order, waiting for their place: each is dead-lettered just before
	// the first later message is settled, so the acks stay in stream
	// order while the messages around it share one transaction.
	held []*job
}

// hold keeps the unhandleable jobs (in stream order, each with its
// failure) until the jobs around them settle.
func (s *settler) hold(jobs []*job) {
	s.held = append(s.held, jobs...)
}

// settleHeldBefore settles the held jobs that come before j in the
// stream: dead-lettered, or abandoned when j's stream was abandoned
// before them.
func (s *settler) settleHeldBefore(j *job) {
	for h := s.nextHeldBefore(j.seq); h != nil; h = s.nextHeldBefore(j.seq) {
		s.deadLetter(h.ctx, h, h.failure)
	}
}

// releaseHeld settles the held jobs that no later job settled.
func (s *settler) releaseHeld() {
	for h := s.nextHeldBefore(math.MaxInt); h != nil; h = s.nextHeldBefore(math.MaxInt) {
		s.deadLetter(h.ctx, h, h.failure)
	}
}

// nextHeldBefore removes and returns the first held job if it comes
// before seq in the stream; nil otherwise.
func (s *settler) nextHeldBefore(seq int) *job {
	if len(s.held) == 0 || s.held[0].seq >= seq {
		return nil
	}
	h := s.held[0]
	s.held = s.held[1:]
	return h
}

// committed settles jobs whose transaction committed, in order.
func (s *settler) committed(jobs []*job, claims []dedup.Result) {
	if len(jobs) > 0 {
		s.p.afterCommit(jobs[0].ctx, jobs, func(i int) bool { return claims[i].Outcome == dedup.Claimed })
	}
	for i, j := range jobs {
		switch {
		case claims[i].Outcome == dedup.Duplicate:
			s.ack(j, ResultDuplicate)
		case claims[i].Outcome == dedup.Conflict:
			s.conflict(j, claims[i].Previous)
		case j.call == nil || j.passedOver:
			s.claimed++
			s.ack(j, ResultSkipped)
		default:
			s.claimed++
			j.runs++ // the run that committed
			s.ack(j, ResultHandled)
		}
	}
}

// ack acks j with the outcome for telemetry.
func (s *settler) ack(j *job, outcome Result) {
	s.ackWith(j, outcome, nil)
}

// ackWith acks j; dl is its dead letter when it was dead-lettered.
func (s *settler) ackWith(j *job, outcome Result, dl *DeadLetter) {
	s.settleHeldBefore(j)
	if s.abandoned {
		// Its effects (or its duplicate's) are committed: the redelivery
		// is skipped as a duplicate.
		s.abandon(j)
		return
	}
	j.settled = true
	p := s.p
	switch outcome {
	case ResultHandled:
		p.stats.handled.Add(1)
	case ResultDuplicate:
		p.stats.duplicates.Add(1)
	case ResultSkipped:
		p.stats.skipped.Add(1)
	}
	p.tel.outcome(j.ctx, j.span, string(outcome))
	errorType := ""
	if dl != nil {
		errorType = string(dl.Kind)
	}
	p.tel.processed(j.ctx, j.m, j.start, errorType)
	if err := s.ackDelivery(j, dl != nil); err != nil {
		p.cfg.Telemetry.Logger.WarnContext(j.ctx, ackFailedMessage(dl != nil),
			"consumer", p.cfg.Name, "event_id", j.idt.id, "error", err)
	}
	j.result = outcome
	p.outcome(j.ctx, j, outcome, dl)
}

// ackFailedMessage says what the broker's redelivery of a message whose ack
// failed will meet: a handled (or duplicate) message's claim is committed,
// so it is skipped; a dead-lettered one has no claim, so it runs again and
// may be dead-lettered again, a second copy. Whether a dead-lettered one is
// redelivered at all is the adapter's to say, in the error: the Kafka
// adapter with OffsetsInDatabase marks the offset before it records the
// dead letter in the database, and a failure of that record leaves the
// record redelivered only if the partition changes owner first.
func ackFailedMessage(deadLettered bool) string {
	if deadLettered {
		return "once: ack of a dead-lettered message failed; the message may be redelivered (the error says when), and then may be dead-lettered again"
	}
	return "once: ack failed; the message will be redelivered and skipped"
}

// conflict settles a message whose id was processed before with another
// fingerprint, per Config.Identify.OnConflict.
func (s *settler) conflict(j *job, prev dedup.Previous) {
	if s.p.cfg.Identify.OnConflict == SkipConflicts {
		s.p.cfg.Telemetry.Logger.WarnContext(j.ctx, "once: event id seen before with a different payload; skipped",
			"consumer", s.p.cfg.Name, "event_id", j.idt.id, "processed_at", prev.ProcessedAt)
		j.conflict = true
		s.ack(j, ResultSkipped)
		return
	}
	s.deadLetter(j.ctx, j, &DeadLetter{Kind: KindIDConflict,
		Error: "event id was processed before with a different payload fingerprint",
		Extra: map[string]string{
			HeaderFingerprint:         hex.EncodeToString(j.fp),
			HeaderOriginalFingerprint: hex.EncodeToString(prev.Fingerprint),
			HeaderOriginalProcessedAt: prev.ProcessedAt.UTC().Format(time.RFC3339Nano),
		}})
}

// deadLetter writes j to the dead-letter destination, retrying until the
// broker confirms it, then acks it. Neither the crash guard's isolation
// nor any other message waits on it.
func (s *settler) deadLetter(ctx context.Context, j *job, dl *DeadLetter) {
	s.settleHeldBefore(j)
	if s.abandoned {
		s.abandon(j)
		return
	}
	p := s.p
	dl.Consumer, dl.EventID, dl.EventType = p.cfg.Name, j.idt.id, j.idt.typ
	dl.FailedAt = time.Now()
	dl.TraceParent = p.tel.traceParent(ctx)
	if err := p.infraFor(ctx, s, "writing a dead letter (the message stays unacked)", Retry{EventID: j.idt.id, Message: j.m, Messages: 1}, func() error {
		return p.watchedSourceCall(&j.watch, "Delivery.DeadLetter", j.m, j.idt.id, 1, func() error { return j.d.DeadLetter(ctx, dl) })
	}); err != nil {
		s.abandon(j)
		return
	}
	crashPoint("after-dead-letter")
	p.stats.deadLettered.Add(1)
	p.tel.deadLetter(ctx, j.span, dl.Kind, dl.Error)
	p.cfg.Telemetry.Logger.WarnContext(ctx, "once: message dead-lettered", "consumer", p.cfg.Name, "event_id", dl.EventID,
		"event_type", dl.EventType, "kind", dl.Kind, "error", dl.Error, "topic", j.m.Topic)
	p.guard.settled(ctx, j)
	s.ackWith(j, ResultDeadLettered, dl)
}

// ackDelivery acks j's delivery under a context that outlives the job's (a
// held dead letter is settled after its batch ended) but not the shutdown
// deadline: an adapter's ack that writes (the Kafka adapter's record of a
// dead letter in the database) must not hold Run past ShutdownTimeout.
// Only a dead letter's ack carries the message's context values (its
// span) on a context of its own; every other ack, one per message on the
// hot path, gets the pipeline's work context and allocates nothing.
func (s *settler) ackDelivery(j *job, deadLettered bool) error {
	p := s.p
	if !deadLettered {
		return p.watchedSourceCall(&j.watch, "Delivery.Ack", j.m, j.idt.id, 1, func() error { return j.d.Ack(p.work) })
	}
	ctx, cancel := p.detached(j.ctx)
	defer cancel()
	return p.watchedSourceCall(&j.watch, "Delivery.Ack", j.m, j.idt.id, 1, func() error { return j.d.Ack(ctx) })
}

// sourceCall calls f, a method of the source or of its Delivery, and
// returns a panic in it as an error wrapping ErrSourceBroken: a panicking
// Ack is an ack that failed, a panicking DeadLetter a dead letter not
// written, a panicking RecordProgress or FirstPositionDone a transaction
// that failed, a panicking BindProgress a Run that cannot start, a
// panicking Close a Close that failed, a panicking MessagingSystem or
// ConsumerGroup a New that failed.
func sourceCall(method string, f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %s panicked: %v\n%s", ErrSourceBroken, method, r, debug.Stack())
		}
	}()
	return f()
}

// abandon leaves j unacked: the broker delivers it again. What the crash
// guard recorded for it is taken back unless the handling stalled.
func (s *settler) abandon(j *job) {
	for h := s.nextHeldBefore(j.seq); h != nil; h = s.nextHeldBefore(j.seq) {
		// Earlier in the stream than j, and not settled: abandoned
		// with it, to be dead-lettered again on redelivery.
		s.abandon(h)
	}
	s.abandoned = true
	if j.settled {
		return
	}
	j.settled = true
	j.span.SetAttributes(attribute.String("once.outcome", "abandoned"))
	s.p.cfg.Telemetry.Logger.DebugContext(j.ctx, "once: message abandoned unacked", "consumer", s.p.cfg.Name, "event_id", j.idt.id)
	s.p.guard.forget(j)
	j.result = ResultAbandoned
	s.p.outcome(j.ctx, j, ResultAbandoned, nil)
}

// abandonAll abandons jobs.
func (s *settler) abandonAll(jobs []*job) {
	for _, j := range jobs {
		s.abandon(j)
	}
}
