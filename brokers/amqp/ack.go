package amqp

import (
	"slices"
	"sync"
	"time"
)

// ackLinger is how long an ack that cannot be coalesced yet (an earlier
// delivery of the channel is still being handled) waits for the gap to
// close before it is sent alone; each gap gets a linger of its own from
// when it opened (acker.flush). Concurrent transactions commit out of
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
	// gapSince is when the prefix last stopped below unsent tags: the
	// start of the current gap's linger (zero while nothing is unsent).
	gapSince time.Time
	// alone holds the tags above floor that were sent one by one, as
	// sorted, disjoint, non-adjacent spans: while an early delivery is
	// stuck (retried for a long time), the tags acked after it stay here
	// in a few spans instead of one entry each.
	alone []span
	// sentFrames counts basic.ack frames, for tests.
	sentFrames int
	// final is set by the last flush, at stop: tags acked later are
	// refused (see ack).
	final bool

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

// ack records that the consumer settled tag; it is sent soon. It reports
// false, recording nothing, once the acker stopped: its last flush is
// over, and nothing would send the tag.
func (a *acker) ack(tag uint64) bool {
	a.mu.Lock()
	if a.final {
		a.mu.Unlock()
		return false
	}
	if tag > a.floor {
		a.unsent[tag] = struct{}{}
	}
	a.mu.Unlock()
	select {
	case a.wake <- struct{}{}:
	default:
	}
	return true
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
	gather := time.NewTimer(time.Hour)
	gather.Stop()
	gathering := false // acks gather until the gather timer fires
	var last time.Time // when the last flush ran
	flush := func() {
		last = time.Now()
		if wait := a.flush(last, false); wait > 0 {
			// The current gap's deadline: it moves only when the gap
			// does, so resetting it here never postpones a linger.
			linger.Reset(wait)
		} else {
			linger.Stop()
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
			flush()
		case <-gather.C:
			gathering = false
			flush()
		case <-linger.C:
			flush()
		case <-a.stopped:
			linger.Stop()
			gather.Stop()
			a.flush(time.Now(), true)
			return
		}
	}
}

// flush sends, at now, the multiple ack of the contiguous prefix and, when
// all is set, the held tags reach a.hold or the current gap has lasted
// a.linger, every other unsent tag alone. It returns how long until the
// current gap's linger ends if unsent tags remain, else 0.
//
// A gap's linger starts when the prefix stopped moving with tags acked
// behind it: each time the prefix moves, the gap below the waiting tags
// is a new one (the one before closed) and gets a linger of its own.
// Concurrent transactions commit out of order all the time, so some gap
// is nearly always open; a linger counted from the first of them would
// send whatever waits when it ends one by one, though every gap closes
// within milliseconds.
func (a *acker) flush(now time.Time, all bool) (wait time.Duration) {
	a.mu.Lock()
	if all {
		a.final = true
	}
	before := a.floor
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
	switch {
	case len(a.unsent) == 0:
		a.gapSince = time.Time{}
	case a.floor != before || a.gapSince.IsZero():
		a.gapSince = now
	}
	expired := len(a.unsent) > 0 && now.Sub(a.gapSince) >= a.linger
	var alone []uint64
	if (all || expired || len(a.unsent) >= a.hold) && len(a.unsent) > 0 {
		alone = make([]uint64, 0, len(a.unsent))
		for tag := range a.unsent {
			alone = append(alone, tag)
		}
		clear(a.unsent)
		slices.Sort(alone)
		a.alone = mergeSpans(a.alone, alone)
		a.gapSince = time.Time{}
	}
	if len(a.unsent) > 0 {
		wait = max(a.linger-now.Sub(a.gapSince), time.Nanosecond)
	}
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
	return wait
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
