package consumer

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// Hooks let a service observe and extend what happens to its messages:
// metrics or logs of its own, an action once a transaction has committed
// (a cache invalidation, a notification), a wrapper around every handler
// call. Every field is optional. Hooks run on the goroutine that handles
// the message, so keep them quick; a panic in a hook (other than
// Middleware, which is part of the handler) is logged and otherwise
// ignored. A hook is never cut short (AfterCommit and OnOutcome run once
// the transaction committed, which cutting them would not undo): one that
// hangs holds its stream until it returns, and is logged at Error once it
// has run past Config.HandlerTimeout, naming the hook and its message.
type Hooks struct {
	// OnOutcome is called once for each message this process settles or
	// gives up: handled, duplicate, skipped, dead-lettered (after the
	// broker confirmed the copy), abandoned (left unacked for
	// redelivery). It is called after the ack (or the abandonment).
	OnOutcome func(ctx context.Context, o Outcome)
	// OnRetry is called before each wait for another attempt: after a
	// handler failure (Reason RetryHandler), a Decoder's, an Envelope's or
	// an Identify.EventID's RetryAfter (RetryDecode) or an infrastructure
	// failure (RetryInfrastructure: the database or the dead-letter
	// destination is failing, and the consumer waits for it).
	OnRetry func(ctx context.Context, r Retry)
	// AfterCommit is called once the transaction that handled messages
	// has committed, before they are acked, with the events whose handler
	// ran in it (not the duplicates). It runs at most once per event: a
	// crash between the commit and the hook skips it, and a redelivery is
	// then a duplicate. What must happen exactly once belongs in the
	// transaction itself (or an outbox row written there).
	AfterCommit func(ctx context.Context, events []Committed)
	// Middleware wraps every call of a Handler, first element outermost
	// (NewBatch refuses it: a BatchHandler's batches hold one event or many
	// as the load makes them, so wrap the BatchHandler itself). A
	// middleware calls next to run the handler, at most once: a second
	// call returns ErrNextCalledTwice without running the handler
	// (retrying belongs to Config.Retry, which starts a new transaction).
	// One that returns an error without calling next fails the event as
	// the handler's error would. One that returns nil without calling it
	// (a filter) skips the event: its id is recorded as processed and it
	// is acked without a handler, as an unknown type is under
	// SkipUnknownTypes: reported ResultSkipped, counted in Stats.Skipped,
	// not given to AfterCommit, and a duplicate when redelivered. It runs
	// inside the message's transaction: tx is the handler's. It may pass
	// next a tx of its own that wraps tx (to trace or count statements);
	// Event.Queue works in the handler all the same. Its error, or its
	// panic, is the handler's.
	Middleware []Middleware
}

// Result is what became of a message.
type Result string

// The results a message can have.
const (
	ResultHandled      Result = "handled"
	ResultDuplicate    Result = "duplicate"
	ResultSkipped      Result = "skipped"
	ResultDeadLettered Result = "dead_lettered"
	ResultAbandoned    Result = "abandoned"
)

// Outcome describes a settled message, for Hooks.OnOutcome.
type Outcome struct {
	// Result is what became of the message.
	Result Result
	// EventID and EventType as the consumer identified them (empty when
	// the message could not be identified).
	EventID, EventType string
	// Message is the broker message. Do not modify it.
	Message *Message
	// Runs is how many runs of the handler counted for the message: its
	// failed attempts (also runs cut short by a crash, as the crash guard
	// saw them) and the run that committed. A run rolled back because
	// another message of its batch failed does not count, as it does not
	// count against RetryPolicy.MaxAttempts: the handler may have been
	// called more often than Runs.
	Runs int
	// DeadLetter is set when Result is ResultDeadLettered: the kind, the
	// error and the diagnostics written with the copy.
	DeadLetter *DeadLetter
}

// RetryReason says why an attempt is repeated.
type RetryReason string

// The reasons for a retry.
const (
	RetryHandler        RetryReason = "handler"
	RetryInfrastructure RetryReason = "infrastructure"
	// RetryDecode: the Decoder, the Envelope or Identify.EventID failed
	// with RetryAfter (a schema registry or an id service it depends on is
	// down, say); the message is identified and decoded again after the
	// delay it asked for.
	RetryDecode RetryReason = "decode"
)

// Retry describes a wait before another attempt, for Hooks.OnRetry.
type Retry struct {
	Reason RetryReason
	// EventID is the message's id; empty when the failure is a batch's,
	// or when the message has no id yet (Reason RetryDecode after an
	// Identify.EventID that asked for a retry) or none (a dead letter of
	// kind missing-id being written).
	EventID string
	// Message is the message that waits, when the failure is one
	// message's (Messages 1; nil for a batch's): its Topic, Partition and
	// Offset tell which one when EventID is empty. Do not modify it.
	Message *Message
	// Messages is how many messages wait for the retry.
	Messages int
	// Err is the failure.
	Err error
	// Wait is how long the consumer waits before trying again.
	Wait time.Duration
}

// Committed is an event whose handler's transaction committed, for
// Hooks.AfterCommit.
type Committed struct {
	EventID, EventType string
	Message            *Message
}

// HandlerInfo describes the handler call a Middleware wraps.
type HandlerInfo struct {
	EventID, EventType string
	Message            *Message
	// Attempt is the handler's run for this message, from 1.
	Attempt int
}

// Middleware wraps a handler call; see Hooks.Middleware.
type Middleware func(ctx context.Context, tx pgx.Tx, info HandlerInfo, next func(context.Context, pgx.Tx) error) error

// ErrNextCalledTwice is what a middleware's next returns, without running
// the handler, when it is called again for the same event in the same
// transaction (a middleware that retries the handler after it failed):
// the failed run's writes are still in the transaction, and would be
// committed beside the next run's. Returned by the middleware, it is a
// failure of the handler: the message is retried in a new transaction as
// Config.Retry says.
var ErrNextCalledTwice = errors.New("once: a middleware called next twice for one event; the handler runs once per transaction")

// wrap returns the call of j's handler through the middleware.
func (h *Hooks) wrap(j *job, attempt int, call func(context.Context, pgx.Tx) error) func(context.Context, pgx.Tx) error {
	if len(h.Middleware) == 0 {
		return call
	}
	info := HandlerInfo{EventID: j.idt.id, EventType: j.idt.typ, Message: j.m, Attempt: attempt}
	j.passedOver = false
	var called atomic.Bool
	handler := call
	call = func(ctx context.Context, tx pgx.Tx) error {
		if called.Swap(true) {
			return ErrNextCalledTwice
		}
		return handler(ctx, tx)
	}
	for i := len(h.Middleware) - 1; i >= 0; i-- {
		mw, next := h.Middleware[i], call
		call = func(ctx context.Context, tx pgx.Tx) error { return mw(ctx, tx, info, next) }
	}
	outer := call
	return func(ctx context.Context, tx pgx.Tx) error {
		err := outer(ctx, tx)
		// Success without the handler: the middleware skipped the event.
		j.passedOver = err == nil && !called.Load()
		return err
	}
}

// outcome reports j's outcome to OnOutcome.
func (p *pipeline) outcome(ctx context.Context, j *job, r Result, dl *DeadLetter) {
	if p.cfg.Hooks.OnOutcome == nil {
		return
	}
	o := Outcome{Result: r, EventID: j.idt.id, EventType: j.idt.typ, Message: j.m, Runs: j.runs, DeadLetter: dl}
	p.watch.begin(&j.watch, "OnOutcome", j.m, j.idt.id, 1)
	defer p.watch.end(&j.watch)
	p.safeHook(ctx, "OnOutcome", func() error { p.cfg.Hooks.OnOutcome(ctx, o); return nil })
}

// retrying reports a coming retry to OnRetry.
func (p *pipeline) retrying(ctx context.Context, r Retry) {
	if p.cfg.Hooks.OnRetry == nil {
		return
	}
	c := new(userCall)
	p.watch.begin(c, "OnRetry", nil, r.EventID, r.Messages)
	defer p.watch.end(c)
	p.safeHook(ctx, "OnRetry", func() error { p.cfg.Hooks.OnRetry(ctx, r); return nil })
}

// afterCommit reports the events whose handlers committed in one
// transaction to AfterCommit.
func (p *pipeline) afterCommit(ctx context.Context, jobs []*job, claimed func(i int) bool) {
	if p.cfg.Hooks.AfterCommit == nil {
		return
	}
	var events []Committed
	for i, j := range jobs {
		if claimed(i) && j.call != nil && !j.passedOver {
			events = append(events, Committed{EventID: j.idt.id, EventType: j.idt.typ, Message: j.m})
		}
	}
	if len(events) > 0 {
		c := new(userCall)
		var m *Message
		var id string
		if len(events) == 1 {
			m, id = events[0].Message, events[0].EventID
		}
		p.watch.begin(c, "AfterCommit", m, id, len(events))
		defer p.watch.end(c)
		p.safeHook(ctx, "AfterCommit", func() error { p.cfg.Hooks.AfterCommit(ctx, events); return nil })
	}
}

// safeHook runs a hook, logging its panic instead of letting it end the
// process or the message's handling.
func (p *pipeline) safeHook(ctx context.Context, name string, f func() error) {
	defer func() {
		if r := recover(); r != nil {
			p.cfg.Telemetry.Logger.ErrorContext(ctx, "once: a hook panicked", "consumer", p.cfg.Name, "hook", name,
				"panic", fmt.Sprint(r), "stack", string(debug.Stack()))
		}
	}()
	if err := f(); err != nil && !errors.Is(err, context.Canceled) {
		p.cfg.Telemetry.Logger.WarnContext(ctx, "once: a hook failed", "consumer", p.cfg.Name, "hook", name, "error", err)
	}
}
