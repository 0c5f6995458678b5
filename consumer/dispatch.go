package consumer

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// dispatcher routes deliveries to workers: one lane per stream, so a
// stream's messages are handled in order, and a shared pool of workers for
// deliveries without a stream.
type dispatcher struct {
	p    *pipeline
	work context.Context
	wg   sync.WaitGroup
	// lanes is touched only by the receiving goroutine.
	lanes map[string]*lane
	// budget holds a token for each delivery waiting in a lane: receiving
	// blocks while Config.ReceiveBuffer deliveries wait.
	budget    chan struct{}
	unordered chan Delivery
	// retired counts lanes whose worker stopped since the last sweep.
	retired chan struct{}
}

func newDispatcher(p *pipeline, work context.Context) *dispatcher {
	d := &dispatcher{p: p, work: work, lanes: map[string]*lane{},
		budget:    make(chan struct{}, p.cfg.ReceiveBuffer),
		unordered: make(chan Delivery, p.cfg.ReceiveBuffer),
		retired:   make(chan struct{}, 1)}
	for i := 0; i < p.cfg.Concurrency; i++ {
		d.wg.Add(1)
		go d.unorderedWorker()
	}
	return d
}

// receive feeds deliveries to workers until ctx is done or the source
// fails; it returns the source's fatal error, if any.
func (d *dispatcher) receive(ctx context.Context) error {
	for {
		dv, err := d.p.src.Receive(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("once: consumer %q: receive: %w", d.p.cfg.Name, err)
		}
		d.p.stats.received.Add(1)
		d.p.tel.received(ctx, dv.Message())
		if !d.dispatch(ctx, dv) {
			return nil // dv is abandoned unacked: the broker redelivers it
		}
	}
}

// dispatch queues dv for its lane, or for the unordered workers, once the
// budget allows; it reports false if ctx ended first.
func (d *dispatcher) dispatch(ctx context.Context, dv Delivery) bool {
	stream := dv.Message().Stream
	if stream == "" {
		select {
		case d.unordered <- dv:
			return true
		case <-ctx.Done():
			return false
		}
	}
	select {
	case d.budget <- struct{}{}:
	case <-ctx.Done():
		return false
	}
	for !d.lane(stream).push(dv) {
		// The lane retired (its assignment ended) between our look and
		// the push: a new lane takes the stream.
		delete(d.lanes, stream)
	}
	return true
}

// lane returns the stream's lane, starting it if needed.
func (d *dispatcher) lane(stream string) *lane {
	select {
	case <-d.retired:
		d.sweep()
	default:
	}
	l, ok := d.lanes[stream]
	if !ok {
		l = newLane()
		d.lanes[stream] = l
		d.wg.Add(1)
		go d.orderedWorker(l)
	}
	return l
}

// sweep forgets retired lanes, so that a consumer whose partitions move
// between processes keeps no lane (and no goroutine) for each partition it
// ever owned.
func (d *dispatcher) sweep() {
	for stream, l := range d.lanes {
		if l.isRetired() {
			delete(d.lanes, stream)
		}
	}
}

// close lets every worker drain what it holds, then stop.
func (d *dispatcher) close() {
	for _, l := range d.lanes {
		l.close()
	}
	close(d.unordered)
}

// orderedWorker handles one stream's deliveries in order, in batches.
// After each new assignment of the stream (a new Delivery.Context), the
// first Batch.Size new messages are marked by the crash guard (guard.go).
// The worker retires once its assignment has ended and nothing waits.
func (d *dispatcher) orderedWorker(l *lane) {
	defer d.wg.Done()
	var assignment context.Context
	var s *settler
	window := 0
	for {
		batch := l.next(d.p.cfg.Batch.Size, d.p.linger(), assignment)
		if batch == nil {
			if l.isRetired() {
				select {
				case d.retired <- struct{}{}:
				default:
				}
			}
			return
		}
		for range batch {
			<-d.budget
		}
		for len(batch) > 0 {
			if c := batch[0].Context(); c != assignment {
				assignment, window, s = c, d.p.cfg.Batch.Size, &settler{p: d.p}
			}
			n := 1
			for n < len(batch) && batch[n].Context() == assignment {
				n++
			}
			if d.p.stopping.Load() {
				// Never started: left unacked, and nothing after them
				// may be acked either.
				s.abandoned = true
			} else {
				window -= d.p.process(d.work, batch[:n], window > 0, s)
			}
			batch = batch[n:]
		}
	}
}

// unorderedWorker handles deliveries without a stream, batching what is
// waiting; a batch never mixes deliveries of different channels. A
// delivery the broker marks as redelivered (a suspect for the crash guard)
// is handled as a batch of its own, so that a suspect waiting between its
// attempts holds up only its worker while the others go on.
func (d *dispatcher) unorderedWorker() {
	defer d.wg.Done()
	var carry Delivery
	for {
		first := carry
		carry = nil
		if first == nil {
			var ok bool
			if first, ok = <-d.unordered; !ok {
				return
			}
		}
		if d.p.stopping.Load() {
			continue
		}
		batch := []Delivery{first}
		if !mayBeRedelivery(first) {
			batch, carry = d.p.collect(first, d.unordered)
		}
		// A batch shares one fate, so it must not mix deliveries of
		// different channels: abandoning a batch because one channel died
		// would leave the others' deliveries unacked on a live channel.
		for len(batch) > 0 && !d.p.stopping.Load() {
			n := 1
			for n < len(batch) && batch[n].Context() == batch[0].Context() {
				n++
			}
			d.p.process(d.work, batch[:n], false, &settler{p: d.p})
			batch = batch[n:]
		}
	}
}

// linger is how long a worker waits for a batch to fill: Config.
// Batch.Linger, or none when batches are off.
func (p *pipeline) linger() time.Duration {
	if p.cfg.Batch.Size <= 1 {
		return 0
	}
	return p.cfg.Batch.Linger
}

// collect returns first plus the deliveries already waiting in ch, up to
// Config.Batch.Size, waiting at most Config.Batch.Linger for more. With no
// linger a batch is whatever accumulated while the previous one was being
// handled: one message under light load, full batches under heavy load. A
// redelivered delivery ends the batch and is returned apart, to be handled
// alone.
func (p *pipeline) collect(first Delivery, ch <-chan Delivery) (batch []Delivery, redelivered Delivery) {
	batch = []Delivery{first}
	var linger <-chan time.Time
	if d := p.linger(); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		linger = t.C
	}
	for len(batch) < p.cfg.Batch.Size {
		var dv Delivery
		var ok bool
		if linger == nil {
			select {
			case dv, ok = <-ch:
			default:
				return batch, nil
			}
		} else {
			select {
			case dv, ok = <-ch:
			case <-linger:
				return batch, nil
			}
		}
		switch {
		case !ok:
			return batch, nil
		case mayBeRedelivery(dv):
			return batch, dv
		}
		batch = append(batch, dv)
	}
	return batch, nil
}
