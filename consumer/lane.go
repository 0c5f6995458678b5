package consumer

import (
	"context"
	"sync"
	"time"
)

// lane is the queue of one stream's received deliveries, in order. Its
// length has no bound of its own: the dispatcher's budget (Config.
// ReceiveBuffer) bounds what waits across all lanes, so that a full lane
// never keeps the others waiting (with a bound per lane, the dispatcher
// blocks on the one full lane while the others run dry, and the lanes fall
// into lockstep behind the slowest). A source that bounds each stream by
// itself (StreamBounder) has no budget: its own bound holds each lane.
type lane struct {
	mu     sync.Mutex
	q      []received
	closed bool
	// retired: the worker stopped because the stream's assignment ended
	// with nothing queued; a push must go to a new lane.
	retired bool
	// ready holds a token when q changed or the lane closed since the
	// worker last looked.
	ready chan struct{}
}

func newLane() *lane { return &lane{ready: make(chan struct{}, 1)} }

// push appends dv; it never blocks. It reports false, queuing nothing,
// when the lane has retired.
func (l *lane) push(dv received) bool {
	l.mu.Lock()
	if l.retired {
		l.mu.Unlock()
		return false
	}
	l.q = append(l.q, dv)
	l.mu.Unlock()
	l.wake()
	return true
}

func (l *lane) isRetired() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.retired
}

// close lets the worker drain what is queued, then stop.
func (l *lane) close() {
	l.mu.Lock()
	l.closed = true
	l.mu.Unlock()
	l.wake()
}

func (l *lane) wake() {
	select {
	case l.ready <- struct{}{}:
	default:
	}
}

// next blocks until deliveries wait in the lane and returns up to max of
// them, in order: what is already queued, or, with a linger, what arrives
// within it, up to max. It returns nil once the lane is closed and empty,
// or once assignment (the context of the last deliveries taken; nil before
// the first) has ended with nothing queued: the lane then retires, so that
// a revoked partition's lane and worker are released.
func (l *lane) next(max int, linger time.Duration, assignment context.Context) []received {
	var ended <-chan struct{}
	if assignment != nil {
		ended = assignment.Done()
	}
	for {
		l.mu.Lock()
		if len(l.q) > 0 {
			break
		}
		if l.closed {
			l.mu.Unlock()
			return nil
		}
		if assignment != nil && assignment.Err() != nil {
			l.retired = true
			l.mu.Unlock()
			return nil
		}
		l.mu.Unlock()
		select {
		case <-l.ready:
		case <-ended:
		}
	}
	if linger > 0 && len(l.q) < max && !l.closed {
		l.mu.Unlock()
		l.linger(max, linger)
		l.mu.Lock()
	}
	defer l.mu.Unlock()
	return l.take(min(max, len(l.q)))
}

// takeFull returns the next max deliveries if that many are queued and
// all belong to assignment, else nil; it never waits. An ordered worker
// uses it to identify its next batch while the one before runs: only a
// full batch, so that a light stream's messages are never held back for
// a batch taken early.
func (l *lane) takeFull(max int, assignment context.Context) []received {
	l.mu.Lock()
	defer l.mu.Unlock()
	if n := l.prefixOf(max, assignment); n == max {
		return l.take(n)
	}
	return nil
}

// takeUpTo returns up to max queued deliveries of assignment, from the
// front of the queue, without waiting; none when max <= 0.
func (l *lane) takeUpTo(max int, assignment context.Context) []received {
	l.mu.Lock()
	defer l.mu.Unlock()
	if n := l.prefixOf(max, assignment); n > 0 {
		return l.take(n)
	}
	return nil
}

// prefixOf returns how many of the first max queued deliveries belong to
// assignment, stopping at the first that does not; l.mu is held.
func (l *lane) prefixOf(max int, assignment context.Context) int {
	n := 0
	for n < min(max, len(l.q)) && l.q[n].dctx == assignment {
		n++
	}
	return n
}

// take removes the first n deliveries from the queue and returns them;
// l.mu is held.
func (l *lane) take(n int) []received {
	batch := make([]received, n)
	copy(batch, l.q)
	// Move the rest to the front, so the backing array is reused and
	// keeps no delivery alive after it was taken.
	rest := copy(l.q, l.q[n:])
	clear(l.q[rest:])
	l.q = l.q[:rest]
	return batch
}

// linger waits until max deliveries are queued, the lane closes, or d
// passes.
func (l *lane) linger(max int, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		l.mu.Lock()
		full := len(l.q) >= max || l.closed
		l.mu.Unlock()
		if full {
			return
		}
		select {
		case <-l.ready:
		case <-t.C:
			return
		}
	}
}
