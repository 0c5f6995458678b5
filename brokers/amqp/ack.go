package amqp

import (
	"slices"
	"sync"
	"time"
)

// ackLinger is how long an ack that cannot be coalesced yet (an earlier
// delivery of the channel is still being handled) waits for the gap to
// close before it is sent alone. Concurrent transactions commit out of
// order by up to a few of their own durations (under load, tens of
// milliseconds): waiting that long turns a batch committed early into
// part of one multiple ack instead of one frame per delivery, and a frame
// per delivery cost the broker about 50 µs of CPU each on the development
// machine (docs/performance.md). The acks are held only at the broker:
// the messages' effects are committed. Held acks are sent sooner when
// they fill half the prefetch (acker.hold), so a delivery stuck in
// retries never stops the broker delivering.
const ackLinger = 100 * time.Millisecond

// ackGather is the least time between two flushes of the acker: the acks
// given meanwhile (a committed batch's, acked one by one) go out in one
// multiple ack instead of a frame each as the acker's goroutine wakes for
// each of them. It delays an ack at the broker by at most this much; the
// message's effects are committed before it is acked at all.
const ackGather = time.Millisecond

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
	// linger is ackLinger (tests shorten or lengthen it).
	linger time.Duration
	// gather is ackGather (tests shorten or lengthen it).
	gather time.Duration
	// hold is how many acks may wait for a gap before they are sent one
	// by one without waiting for the linger: half the prefetch, since
	// each is a delivery the broker counts as unacked and a channel at
	// its prefetch gets no more deliveries.
	hold int

	mu sync.Mutex
	// floor: every tag up to it is acked at the broker (or covered by a
	// sent multiple ack).
	floor uint64
	// unsent holds tags above floor that the consumer acked and that were
	// not sent yet; they are outstanding at the broker, so there are at
	// most Config.Prefetch of them.
	unsent map[uint64]struct{}
	// alone holds the tags above floor that were sent one by one, as
	// sorted, disjoint, non-adjacent spans: while an early delivery is
	// stuck (retried for a long time), the tags acked after it stay here
	// in a few spans instead of one entry each.
	alone []span
	// sentFrames counts basic.ack frames, for tests.
	sentFrames int

	wake    chan struct{}
	stopped chan struct{}
	done    chan struct{}
	once    sync.Once
}

// span is the tags lo to hi, inclusive.
type span struct{ lo, hi uint64 }

func newAcker(ch ackSender, prefetch int) *acker {
	a := &acker{
		ch:      ch,
		linger:  ackLinger,
		gather:  ackGather,
		hold:    max(1, prefetch/2),
		unsent:  map[uint64]struct{}{},
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
		a.unsent[tag] = struct{}{}
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
	gather := time.NewTimer(time.Hour)
	gather.Stop()
	gathering := false // acks gather until the gather timer fires
	var last time.Time // when the last flush ran
	flush := func(singles bool) {
		last = time.Now()
		if a.flush(singles) && !armed {
			linger.Reset(a.linger)
			armed = true
		}
	}
	for {
		select {
		case <-a.wake:
			if gathering {
				continue
			}
			if wait := a.gather - time.Since(last); wait > 0 {
				gather.Reset(wait)
				gathering = true
				continue
			}
			flush(false)
		case <-gather.C:
			gathering = false
			flush(false)
		case <-linger.C:
			armed = false
			flush(true)
		case <-a.stopped:
			linger.Stop()
			gather.Stop()
			a.flush(true)
			return
		}
	}
}

// flush sends the multiple ack of the contiguous prefix and, when singles
// is set or the held tags reach a.hold, every other unsent tag alone. It
// reports whether unsent tags remain (to be sent after the linger).
func (a *acker) flush(singles bool) (remaining bool) {
	a.mu.Lock()
	var multi uint64 // the highest tag of the prefix still outstanding
	for {
		next := a.floor + 1
		if _, ok := a.unsent[next]; ok {
			delete(a.unsent, next)
			a.floor, multi = next, next
			continue
		}
		if len(a.alone) > 0 && a.alone[0].lo == next {
			a.floor = a.alone[0].hi
			a.alone = a.alone[1:]
			continue
		}
		break
	}
	var alone []uint64
	if (singles || len(a.unsent) >= a.hold) && len(a.unsent) > 0 {
		alone = make([]uint64, 0, len(a.unsent))
		for tag := range a.unsent {
			alone = append(alone, tag)
		}
		clear(a.unsent)
		slices.Sort(alone)
		a.alone = mergeSpans(a.alone, alone)
	}
	remaining = len(a.unsent) > 0
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

// mergeSpans adds the sorted tags to the sorted spans, joining adjacent
// ones.
func mergeSpans(spans []span, tags []uint64) []span {
	out := make([]span, 0, len(spans)+1)
	add := func(s span) {
		if n := len(out); n > 0 && out[n-1].hi+1 >= s.lo {
			out[n-1].hi = max(out[n-1].hi, s.hi)
			return
		}
		out = append(out, s)
	}
	i := 0
	for _, tag := range tags {
		for i < len(spans) && spans[i].lo < tag {
			add(spans[i])
			i++
		}
		add(span{tag, tag})
	}
	for ; i < len(spans); i++ {
		add(spans[i])
	}
	return out
}

// stats returns the number of ack frames sent, of acks not sent yet and of
// spans of tags sent alone.
func (a *acker) stats() (frames, unsent, spans int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.sentFrames, len(a.unsent), len(a.alone)
}
