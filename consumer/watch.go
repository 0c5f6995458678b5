package consumer

import (
	"context"
	"math"
	"strings"
	"sync"
	"time"
)

// The consumer bounds the handler (HandlerTimeout), but not the other
// functions a service hands it: the Decoder, Identify.EventID,
// Envelope and a custom Identify.Fingerprint take no context, and a hook
// (OnOutcome, OnRetry, AfterCommit) runs once its messages' fate is
// settled, AfterCommit and OnOutcome after the commit, which cutting
// them would not undo; so they are never cut. One that hangs holds its
// stream (an unordered message: a worker) until it returns; the watchdog
// makes that visible: a call that has run for longer than HandlerTimeout
// (DefaultHandlerTimeout under NoHandlerTimeout) is logged at Error once,
// with the function's name, the message's topic, partition, offset (the
// queue, -1 and -1 on RabbitMQ) and event id, and how long it has run,
// and counted in Stats.StuckCalls.
//
// A handler is cut at HandlerTimeout: its context ends. One that ignores
// it is logged once it has run for twice HandlerTimeout
// (handlerWatchAfter), under NoHandlerTimeout never (neverOverdue: such a
// call is watched only for its session and its lock waits).
//
// A send of the statements handlers queued (Event.Queue), which the
// consumer cuts only once its session is found stranded (stranded.go), is
// watched the same way, named "Event.Queue statements". A Source's or
// Delivery's Ack, DeadLetter, RecordProgress and FirstPositionDone are
// watched the same way (watchedSourceCall): they take a context, which the
// built-in adapters honour, but a custom Source stuck in a client call
// without a deadline would hold its stream without a word.

// userCall is a call of a user function in progress, in the watchdog's
// list. A job holds one for its own calls, so watching a call allocates
// nothing.
type userCall struct {
	name     string
	m        *Message
	eventID  string
	messages int
	start    time.Time
	// after is how long this call runs before it is logged; 0 for the
	// watchdog's bound.
	after  time.Duration
	logged bool
	// pid is the server process of a handler call's or a send's
	// transaction; 0 for other calls. lockedBy is what the watchdog last
	// saw a handler call wait for (lockwait.go).
	pid      uint32
	lockedBy []uint32
	// cut ends a send's context; stranded is set once the watchdog cut it
	// because its server process was gone (stranded.go). Both under the
	// watchdog's lock while the call is in progress.
	cut      context.CancelFunc
	stranded bool
	// send: the call is a send of statements that waits for their answer
	// (a handler call may work outside the database); txBegan is when a
	// handler call's transaction began.
	send    bool
	txBegan time.Time
	// step: the call is one of the consumer's own steps in the database
	// (dbstep.go), cut with cutCause; not a user call, never logged.
	step       bool
	cutCause   context.CancelCauseFunc
	prev, next *userCall
}

// watchdog holds the user calls in progress.
type watchdog struct {
	mu   sync.Mutex
	head *userCall
	// after is how long a call runs before it is logged.
	after time.Duration
}

// begin adds c, a call of name for message m (nil for a call on several
// messages, of which there are messages), to the calls in progress.
func (w *watchdog) begin(c *userCall, name string, m *Message, eventID string, messages int) {
	w.beginHandler(c, name, m, eventID, messages, 0, 0, nil, time.Time{})
}

// beginHandler is begin for a handler call, logged once it has run for
// after (0: the watchdog's bound), whose transaction, begun at txBegan,
// has the server process pid (0: none, not sampled for lock waits), and
// which cut ends once that process is gone (nil: never; stranded.go).
func (w *watchdog) beginHandler(c *userCall, name string, m *Message, eventID string, messages int, after time.Duration, pid uint32, cut context.CancelFunc, txBegan time.Time) {
	*c = userCall{name: name, m: m, eventID: eventID, messages: messages, start: time.Now(), after: after, pid: pid, cut: cut, txBegan: txBegan}
	w.add(c)
}

// beginSend is begin for a send of statements, waiting for their answer,
// on a transaction whose server process is pid, which cut ends
// (stranded.go).
func (w *watchdog) beginSend(c *userCall, name string, pid uint32, cut context.CancelFunc) {
	*c = userCall{name: name, start: time.Now(), pid: pid, cut: cut, send: true}
	w.add(c)
}

// beginStep is begin for one of the consumer's own steps in the database
// on a connection whose server process is pid, which cut ends with its
// cause (dbstep.go).
func (w *watchdog) beginStep(c *userCall, pid uint32, cut context.CancelCauseFunc) {
	*c = userCall{name: "database step", start: time.Now(), pid: pid, cutCause: cut, send: true, step: true}
	w.add(c)
}

// add puts c at the head of the calls in progress.
func (w *watchdog) add(c *userCall) {
	w.mu.Lock()
	c.next = w.head
	if w.head != nil {
		w.head.prev = c
	}
	w.head = c
	w.mu.Unlock()
}

// rename names the function c now runs (the next stage of a job's
// preparation): a call of its own, timed from now and not yet logged, so
// that one that hangs after a slow one that was logged (a Decoder after an
// Envelope) is reported, under its own name and for its own time.
func (w *watchdog) rename(c *userCall, name, eventID string) {
	w.mu.Lock()
	c.name, c.eventID = name, eventID
	c.start, c.logged = time.Now(), false
	w.mu.Unlock()
}

// end removes c from the calls in progress.
func (w *watchdog) end(c *userCall) {
	w.mu.Lock()
	if c.prev != nil {
		c.prev.next = c.next
	} else {
		w.head = c.next
	}
	if c.next != nil {
		c.next.prev = c.prev
	}
	c.prev, c.next = nil, nil
	w.mu.Unlock()
}

// stuck is a call past the watchdog's bound, as logged.
type stuck struct {
	name       string
	topic      string
	partition  int32
	offset     int64
	eventID    string
	messages   int
	running    time.Duration
	bound      time.Duration
	hasMessage bool
}

// overdue returns the calls that have run for longer than w.after and
// were not reported yet, and marks them reported.
func (w *watchdog) overdue(now time.Time) []stuck {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []stuck
	for c := w.head; c != nil; c = c.next {
		bound := w.after
		if c.after > 0 {
			bound = c.after
		}
		if c.step || c.logged || now.Sub(c.start) < bound {
			continue
		}
		c.logged = true
		s := stuck{name: c.name, eventID: c.eventID, messages: c.messages, running: now.Sub(c.start), bound: bound}
		if c.m != nil {
			s.hasMessage = true
			s.topic, s.partition, s.offset = c.m.Topic, c.m.Partition, c.m.Offset
		}
		out = append(out, s)
	}
	return out
}

// watchedSourceCall is sourceCall under the watchdog: c, the call of the
// Source's or Delivery's method (named "Delivery.Ack", "Source.RecordProgress"
// in the watchdog's log; the part after the dot in sourceCall's error),
// for message m with eventID, or nil and messages for a call on several.
func (p *pipeline) watchedSourceCall(c *userCall, name string, m *Message, eventID string, messages int, f func() error) error {
	p.watch.begin(c, name, m, eventID, messages)
	defer p.watch.end(c)
	_, method, _ := strings.Cut(name, ".")
	return sourceCall(method, f)
}

// The names of handler calls in the watchdog.
const (
	handlerCall      = "handler"
	batchHandlerCall = "BatchHandler"
)

// handlerWatchAfter is how long a handler call runs before the watchdog
// logs it: twice HandlerTimeout, by which time it has ignored its
// context's end for as long as it was allowed to run (one that returns
// soon after its deadline, as it should, is never logged); 0 under
// NoHandlerTimeout, where a handler may run as long as it needs and is
// not watched.
func (c *Config) handlerWatchAfter() time.Duration {
	if c.HandlerTimeout > 0 {
		return 2 * c.HandlerTimeout
	}
	return 0
}

// neverOverdue is the after of a call the watchdog never logs: a handler
// call under NoHandlerTimeout, watched only for its session (stranded.go)
// and its lock waits (lockwait.go).
const neverOverdue = time.Duration(math.MaxInt64)

// watchesUnboundedHandlers reports whether handler calls under
// NoHandlerTimeout are watched: when their sessions are asked after, or
// sampled for the lock waits the sessions' statement_timeout may cut.
func (p *pipeline) watchesUnboundedHandlers() bool {
	s := p.sessions()
	return p.asksAfterSessions() || s.serverPIDs && s.statementTimeout > 0
}

// watchAfter is how long a user call other than the handler runs before
// the watchdog logs it.
func (c *Config) watchAfter() time.Duration {
	if c.HandlerTimeout > 0 {
		return c.HandlerTimeout
	}
	return DefaultHandlerTimeout
}

// watchUserCalls logs the user calls that run past the watchdog's bound
// until ctx is done.
func (p *pipeline) watchUserCalls(ctx context.Context) {
	t := time.NewTicker(p.watchTick())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			if p.readSessionsAgain(ctx, now) {
				// The sessions' statement_timeout and process ids,
				// unknown until now, may call for a shorter tick.
				t.Reset(p.watchTick())
			}
			p.sampleSessions(ctx, now)
			p.logOverdue(ctx, now)
		}
	}
}

// watchTick is the watchdog's tick: a quarter of its bound, shorter when
// lock waits are sampled or sessions asked after.
func (p *pipeline) watchTick() time.Duration {
	tick := p.watch.after / 4
	if limit := p.lockWaitLimit(); limit > 0 {
		// At least one lock-wait sample in the last half before a cut.
		tick = min(tick, limit/4)
	}
	if p.asksAfterSessions() {
		// A stranded send is cut within a quarter of DatabaseTimeout
		// after it.
		tick = min(tick, p.cfg.DatabaseTimeout/4)
	}
	return max(tick, 10*time.Millisecond)
}

// logOverdue logs, and counts, the calls past the watchdog's bound at now
// not logged yet.
func (p *pipeline) logOverdue(ctx context.Context, now time.Time) {
	for _, s := range p.watch.overdue(now) {
		p.stats.stuckCalls.Add(1)
		p.tel.stuck(ctx, s.name)
		args := []any{"consumer", p.cfg.Name, "function", s.name, "running", s.running, "bound", s.bound}
		if s.hasMessage {
			args = append(args, "topic", s.topic, "partition", s.partition, "offset", s.offset, "event_id", s.eventID)
		} else {
			args = append(args, "messages", s.messages)
			if s.eventID != "" {
				args = append(args, "event_id", s.eventID)
			}
		}
		msg := "once: a call has not returned; it holds its stream (or, unordered, a worker) until it does"
		if s.name == handlerCall || s.name == batchHandlerCall {
			msg = "once: a handler has not returned though its context ended at HandlerTimeout; it holds its stream (or, unordered, a worker) and its transaction until it does"
		}
		p.cfg.Telemetry.Logger.ErrorContext(ctx, msg, args...)
	}
}
