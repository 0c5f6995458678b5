package amqp

import (
	"sync"
	"time"
)

// ackLinger is how long an ack that cannot be coalesced yet (an earlier
// delivery of the channel is still being handled) waits for the gap to
// close before it is sent alone.
const ackLinger = time.Millisecond

// ackSender is the part of *amqp091.Channel the acker uses.
type ackSender interface {
	Ack(tag uint64, multiple bool) error
}

// acker sends the acks of one consuming channel from a goroutine of its
// own, coalescing them into basic.ack frames with the multiple flag.
//
// Delivery tags of a channel with one consumer are 1, 2, 3, ... in
// delivery order. A multiple ack of tag X settles every outstanding
// delivery up to X, so it is sent only when every tag up to X was acked by
// the consumer (the contiguous prefix); X itself must still be outstanding
// at the broker, else the broker closes the channel ("unknown delivery
// tag"). Tags acked out of order wait ackLinger for the prefix to reach
// them, then are sent one by one.
//
// Acks are sent after ack returns; the ones still pending when the channel
// dies are lost, and the broker delivers those messages again (the
// consumer then recognises them as duplicates). stop sends what is pending
// and waits.
type acker struct {
	ch ackSender

	mu sync.Mutex
	// floor: every tag up to it is acked at the broker (or covered by a
	// sent multiple ack).
	floor uint64
	// pending holds tags above floor that the consumer acked; the value is
	// true once the tag was sent alone.
	pending map[uint64]bool
	// unsent counts the false values of pending.
	unsent int
	// sentFrames counts basic.ack frames, for tests.
	sentFrames int

	wake    chan struct{}
	stopped chan struct{}
	done    chan struct{}
	once    sync.Once
}

func newAcker(ch ackSender) *acker {
	a := &acker{
		ch:      ch,
		pending: map[uint64]bool{},
		wake:    make(chan struct{}, 1),
		stopped: make(chan struct{}),
		done:    make(chan struct{}),
	}
	go a.run()
	return a
}

// ack records that the consumer settled tag; it is sent soon.
func (a *acker) ack(tag uint64) {
	a.mu.Lock()
	if tag > a.floor {
		if _, dup := a.pending[tag]; !dup {
			a.pending[tag] = false
			a.unsent++
		}
	}
	a.mu.Unlock()
	select {
	case a.wake <- struct{}{}:
	default:
	}
}

// stop sends the pending acks and ends the acker's goroutine.
func (a *acker) stop() {
	a.once.Do(func() { close(a.stopped) })
	<-a.done
}

func (a *acker) run() {
	defer close(a.done)
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	armed := false // a linger runs: later wakes must not postpone it
	for {
		select {
		case <-a.wake:
			if a.flush(false) && !armed {
				linger.Reset(ackLinger)
				armed = true
			}
		case <-linger.C:
			armed = false
			if a.flush(true) {
				linger.Reset(ackLinger)
				armed = true
			}
		case <-a.stopped:
			linger.Stop()
			a.flush(true)
			return
		}
	}
}

// flush sends the multiple ack of the contiguous prefix and, when singles
// is set, every other unsent tag alone. It reports whether unsent tags
// remain (to be sent after the linger).
func (a *acker) flush(singles bool) (remaining bool) {
	a.mu.Lock()
	var multi uint64
	for {
		sent, ok := a.pending[a.floor+1]
		if !ok {
			break
		}
		a.floor++
		delete(a.pending, a.floor)
		if !sent {
			multi = a.floor // the highest tag of the prefix still outstanding
			a.unsent--
		}
	}
	var alone []uint64
	if singles && a.unsent > 0 {
		for tag, sent := range a.pending {
			if !sent {
				alone = append(alone, tag)
				a.pending[tag] = true
			}
		}
		a.unsent = 0
	}
	remaining = a.unsent > 0
	a.sentFrames += len(alone)
	if multi > 0 {
		a.sentFrames++
	}
	a.mu.Unlock()

	// Errors mean the channel is closed: the broker puts the deliveries
	// back, and the source reconnects.
	if multi > 0 {
		_ = a.ch.Ack(multi, true)
	}
	for _, tag := range alone {
		_ = a.ch.Ack(tag, false)
	}
	return remaining
}

// stats returns the number of ack frames sent and of acks not sent yet.
func (a *acker) stats() (frames, unsent int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.sentFrames, a.unsent
}
