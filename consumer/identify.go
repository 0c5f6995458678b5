package consumer

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceco/once/dedup"
)

// job is one delivery on its way through the pipeline.
type job struct {
	// received is the delivery, with its message and context (never
	// asked of the Delivery again).
	received
	idt identity
	fp  []byte
	// fpSum holds fp when it is the default fingerprint, the SHA-256 of
	// the value (in the job, which is allocated with its batch's).
	fpSum [sha256.Size]byte
	call  call // nil: record the id without a handler
	event any  // the typed *Event, for a BatchHandler
	span  trace.Span
	// start is when the message's processing began.
	start time.Time
	// ctx carries the message's span and ends when the message is
	// abandoned.
	ctx context.Context
	// failure, set by identify, says why the message cannot be handled: it
	// is dead-lettered in its place in the stream.
	failure *DeadLetter
	// undecoded, set by identify instead of failure, is the error of a
	// Decoder, an Envelope or an Identify.EventID that asked with
	// RetryAfter to be tried again later: the message is identified again
	// in its place in the stream (decodeAgain). undecodedKind is the
	// dead-letter kind it gets once Retry.MaxAttempts is spent (KindDecode,
	// or KindMissingID for an EventID's). decodeFailures counts such
	// failures so far, for Retry.MaxAttempts (0: it decoded at its first
	// try).
	undecoded      error
	undecodedKind  ErrorKind
	decodeFailures int
	// seq is the job's place among the deliveries handled together, in
	// stream order.
	seq int

	// runs counts the handler's runs for this message so far, those of
	// earlier processes included when the crash guard knows of them.
	runs  int
	guard guardState
	// watch is the job's user call in progress, for the watchdog
	// (watch.go).
	watch userCall
	// ran: the handler was called with the message; a later run decodes
	// its payload again (runPayload).
	ran bool
	// passedOver: in the run that committed, a middleware returned nil
	// without calling next, so the handler did not run: it is skipped.
	passedOver bool

	// stalled: the handling was cut short while running by the shutdown
	// deadline, its delivery still live, or, for a suspect running alone,
	// by the broker taking its delivery back while its handler ran (a
	// handler slower than RabbitMQ's consumer_timeout). Like a crash, it
	// keeps what the crash guard recorded.
	stalled bool
	// timedOut: the broker took the delivery back, unacked too long
	// (ErrDeliveryTimedOut), before the handler returned.
	timedOut bool
	// settled: acked, dead-lettered or abandoned; nothing more happens to
	// the message in this process.
	settled bool
	// result is how the message was settled; conflict: skipped as an id
	// conflict (Config.Identify.OnConflict SkipConflicts).
	result   Result
	conflict bool
}

// claim is the dedup claim of j's id.
func (j *job) claim(consumer string) dedup.Claim {
	return dedup.Claim{Consumer: consumer, EventID: j.idt.id, Fingerprint: j.fp,
		Source: j.m.Topic, Partition: j.m.Partition, Offset: j.m.Offset}
}

// identify is the pipeline's first stage: it starts the message's span and
// fills j, the message's job, for its handler (event id, type, decoded
// payload, fingerprint). Every user function met here (Envelope, EventID, Decoder,
// the router's lookup, Fingerprint) runs guarded: a panic dead-letters the
// message with kind KindPanic and the stack, like a handler's panic,
// instead of crashing the process on every redelivery.
func (p *pipeline) identify(ctx context.Context, dv received, j *job) {
	ctx, span := p.tel.startSpan(ctx, dv.d, dv.m)
	*j = job{received: dv, span: span, ctx: ctx, start: time.Now()}
	j.failure = p.prepareJob(j)
}

// stageIdentifying is prepareJob's first stage, which runs the Envelope
// and Identify.EventID.
const stageIdentifying = "identifying the event"

// prepareJob fills j from its message, or returns why it cannot be handled.
func (p *pipeline) prepareJob(j *job) (dl *DeadLetter) {
	stage := stageIdentifying
	if p.watchPrepare {
		p.watch.begin(&j.watch, p.identifyCall, j.m, "", 1)
		defer p.watch.end(&j.watch)
	}
	defer func() {
		if r := recover(); r != nil {
			dl = &DeadLetter{Kind: KindPanic, Error: fmt.Sprintf("panic while %s: %v", stage, r), Stack: string(debug.Stack())}
			if stage == stageIdentifying {
				// An Envelope or EventID panicked: the dead letter names
				// the id and type the message carries outside them, as
				// for an envelope that does not open.
				j.idt = p.cfg.unopened(j.m, identity{id: j.m.ID, typ: j.m.Type, payload: j.m.Value})
			}
		}
	}()
	idt, kind, err := p.cfg.identify(j.m)
	j.idt = idt
	if err != nil {
		return unidentified(j, kind, err)
	}
	if j.span.IsRecording() {
		j.span.SetAttributes(attribute.String("messaging.message.id", idt.id), attribute.String("once.event.type", idt.typ))
	}
	stage = "decoding the payload"
	if p.watchPrepare {
		p.watch.rename(&j.watch, "Decoder", idt.id)
	}
	prep, kind, err := p.prepare(j.m, idt, p.cfg.Decoder)
	if err != nil {
		return unidentified(j, kind, err)
	}
	j.call, j.event = prep.call, prep.event
	switch {
	case p.sha256Fingerprint:
		stage = "computing the fingerprint"
		j.fpSum = sha256.Sum256(j.m.Value)
		j.fp = j.fpSum[:]
	case p.cfg.Identify.Fingerprint != nil:
		stage = "computing the fingerprint"
		if p.watchPrepare {
			p.watch.rename(&j.watch, "Identify.Fingerprint", j.idt.id)
		}
		j.fp = p.cfg.Identify.Fingerprint(j.m)
	}
	return nil
}

// unidentified is the dead letter of j, which identify could not prepare
// for its handler (kind, err), or nil when its Decoder, Envelope or
// Identify.EventID failed with RetryAfter (and not Permanent, which wins
// as in Classify): j is then to be identified again later, as a handler's
// RetryAfter is run again (a schema registry or an id service that is down
// for a moment would otherwise send every message of the outage to the
// dead-letter queue). Any other failure comes from the bytes, which fail
// the same way on every try. Only an EventID's error is KindMissingID with
// a RetryAfter in it: the consumer's own "no id" error has none.
func unidentified(j *job, kind ErrorKind, err error) *DeadLetter {
	var ra *RetryAfterError
	var perm *PermanentError
	retriable := kind == KindDecode || kind == KindMissingID
	if retriable && errors.As(err, &ra) && !errors.As(err, &perm) {
		// Read here, under prepareJob's recover, as readableError reads a
		// handler's: an Error method that panics is the decoder's panic,
		// not one where the consumer logs and dead-letters it later.
		_ = err.Error()
		j.undecoded, j.undecodedKind = err, kind
		j.decodeFailures++
		return nil
	}
	return &DeadLetter{Kind: kind, Error: err.Error()}
}
