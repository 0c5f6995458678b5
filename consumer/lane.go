package consumer

import (
	"sync"
	"time"
)

// lane is the queue of one stream's received deliveries, in order. Its
// length has no bound of its own: the dispatcher's budget (Config.
// ReceiveBuffer) bounds what waits across all lanes, so that a full lane
// never keeps the others waiting (with a bound per lane, the dispatcher
// blocks on the one full lane while the others run dry, and the lanes fall
// into lockstep behind the slowest).
type lane struct {
	mu     sync.Mutex
	q      []Delivery
	closed bool
	// ready holds a token when q changed or the lane closed since the
	// worker last looked.
	ready chan struct{}
}

func newLane() *lane { return &lane{ready: make(chan struct{}, 1)} }

// push appends dv; it never blocks.
func (l *lane) push(dv Delivery) {
	l.mu.Lock()
	l.q = append(l.q, dv)
	l.mu.Unlock()
	l.wake()
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
// within it, up to max. It returns nil once the lane is closed and empty.
func (l *lane) next(max int, linger time.Duration) []Delivery {
	for {
		l.mu.Lock()
		if len(l.q) > 0 {
			break
		}
		if l.closed {
			l.mu.Unlock()
			return nil
		}
		l.mu.Unlock()
		<-l.ready
	}
	if linger > 0 && len(l.q) < max && !l.closed {
		l.mu.Unlock()
		l.linger(max, linger)
		l.mu.Lock()
	}
	defer l.mu.Unlock()
	n := min(max, len(l.q))
	batch := make([]Delivery, n)
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
