package consumer

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"runtime/debug"
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
	// blocks while Config.ReceiveBuffer deliveries wait. nil when the
	// source bounds each stream by itself (StreamBounder): a stream stuck
	// with its backlog would otherwise take it all and block receiving
	// for every other stream.
	budget    chan struct{}
	unordered chan received
	// batcher forms the unordered deliveries into batches (batcher.go).
	batcher *batcher
	// retired counts lanes whose worker stopped since the last sweep.
	retired chan struct{}
	// workers counts the unordered workers, and waiting those of them
	// whose batch waits aside (spare); under mu.
	mu               sync.Mutex
	workers, waiting int
	// probed is the last delivery context whose methods receiveOne tried;
	// touched only by the receiving goroutine.
	probed context.Context
}

// contextProbe is the key receiveOne asks a delivery's context's Value
// for.
type contextProbe struct{}

func newDispatcher(p *pipeline, work context.Context) *dispatcher {
	d := &dispatcher{p: p, work: work, lanes: map[string]*lane{},
		unordered: make(chan received, p.cfg.ReceiveBuffer),
		retired:   make(chan struct{}, 1)}
	if !p.streamsBounded {
		d.budget = make(chan struct{}, p.cfg.ReceiveBuffer)
	}
	d.batcher = newBatcher(d)
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		d.batcher.run(d.unordered)
	}()
	d.workers = p.cfg.Concurrency
	for i := 0; i < p.cfg.Concurrency; i++ {
		d.wg.Add(1)
		go d.unorderedWorker()
	}
	p.spare = d.spare
	p.unorderedRunning = &d.batcher.running
	return d
}

// spare starts an unordered worker, if need be, for one whose batch waits
// aside (pipeline.aside): Concurrency of them keep taking batches however
// many wait. The waiting batches hold their deliveries unacked, so the
// source's prefetch bounds them. The batch runs no transaction while it
// waits, and the batcher does not count it as running one: a partial
// batch behind it closes at once, as behind none. It returns the function
// that ends the wait; the surplus worker then retires after its batch.
func (d *dispatcher) spare() (end func()) {
	d.batcher.asideFor(true)
	d.mu.Lock()
	defer d.mu.Unlock()
	d.waiting++
	if d.workers < d.p.cfg.Concurrency+d.waiting {
		d.workers++
		d.wg.Add(1) // the caller's worker is counted: wg is above zero
		go d.unorderedWorker()
	}
	return func() {
		d.mu.Lock()
		d.waiting--
		d.mu.Unlock()
		d.batcher.asideFor(false)
	}
}

// retireSurplus reports whether an unordered worker is one too many, the
// waits it stood in for ended, and counts it out if so.
func (d *dispatcher) retireSurplus() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.workers > d.p.cfg.Concurrency+d.waiting {
		d.workers--
		return true
	}
	return false
}

// receive feeds deliveries to workers until ctx is done or the source
// fails; it returns the source's fatal error, if any.
func (d *dispatcher) receive(ctx context.Context) error {
	for {
		dv, err := d.receiveOne(ctx)
		if err != nil {
			if ctx.Err() != nil && !errors.Is(err, ErrSourceBroken) {
				return nil
			}
			return fmt.Errorf("once: consumer %q: receive: %w", d.p.cfg.Name, err)
		}
		d.p.stats.received.Add(1)
		d.p.tel.received(ctx, dv.m)
		if !d.dispatch(ctx, dv) {
			// dv is abandoned unacked: the broker redelivers it.
			d.p.giveUp(d.work, []received{dv}, &settler{p: d.p})
			return nil
		}
	}
}

// received is a delivery as the consumer keeps it: the source's Delivery
// with what the consumer asks of it, asked once, when it is received
// (receiveOne). The Delivery's Message, Context and DeduplicatedByPosition
// are user code of a custom Source; asked again at every stage, on the
// workers' goroutines, a panic in one of them would end the process, and
// an answer that changed would mislead the stages after.
type received struct {
	d Delivery
	// m is d.Message(), never nil.
	m *Message
	// dctx is d.Context(), never nil, and comparable.
	dctx context.Context
	// byPosition: d is PositionDeduplicated and said true.
	byPosition bool
}

// receiveOne receives the next delivery from the source and asks it for
// its message, its context and, if it is PositionDeduplicated, whether it
// is deduplicated by its position, and tries the Done, Err and Value of
// each context it has not met just before. A delivery that is nil or has
// no message or no context, or a context that cannot be compared, or a
// panic in Receive or in one of those methods, is an error wrapping
// ErrSourceBroken; the delivery is then left
// unsettled, for the broker to deliver again.
func (d *dispatcher) receiveOne(ctx context.Context) (rv received, err error) {
	method := "Receive"
	defer func() {
		if r := recover(); r != nil {
			rv, err = received{}, fmt.Errorf("%w: %s panicked: %v\n%s", ErrSourceBroken, method, r, debug.Stack())
		}
	}()
	dv, err := d.p.src.Receive(ctx)
	switch {
	case err != nil:
		return received{}, err
	case dv == nil:
		return received{}, fmt.Errorf("%w: Receive returned a nil delivery and a nil error", ErrSourceBroken)
	}
	rv.d = dv
	method = "Message"
	if rv.m = dv.Message(); rv.m == nil {
		return received{}, fmt.Errorf("%w: Receive returned a delivery with a nil message", ErrSourceBroken)
	}
	method = "Context"
	if rv.dctx = dv.Context(); rv.dctx == nil {
		return received{}, fmt.Errorf("%w: Receive returned a delivery with a nil context", ErrSourceBroken)
	}
	if !comparableContext(rv.dctx) {
		// Lanes and batches tell assignments apart by comparing
		// contexts, which would panic on a worker's goroutine.
		return received{}, fmt.Errorf("%w: Receive returned a delivery whose context (%T) cannot be compared", ErrSourceBroken, rv.dctx)
	}
	if rv.dctx != d.probed {
		// The workers call the context's Done, Err and Value
		// (context.AfterFunc, a lane's wait for its assignment's end),
		// where a panic would end the process: each is tried here once
		// for each context met (deliveries of one assignment share
		// theirs), its panic the source's broken contract.
		method = "Context().Done"
		_ = rv.dctx.Done()
		method = "Context().Err"
		_ = rv.dctx.Err()
		method = "Context().Value"
		_ = rv.dctx.Value(contextProbe{})
		d.probed = rv.dctx
	}
	if pd, ok := dv.(PositionDeduplicated); ok {
		method = "DeduplicatedByPosition"
		rv.byPosition = pd.DeduplicatedByPosition()
	}
	return rv, nil
}

// comparableContext reports whether c can be compared (==) without a
// panic. A pointer, what contexts almost always are, is answered without
// allocating.
func comparableContext(c context.Context) bool {
	return reflect.TypeOf(c).Kind() == reflect.Pointer || reflect.ValueOf(c).Comparable()
}

// dispatch queues dv for its lane, or for the unordered workers, once the
// budget allows; it reports false if ctx ended first.
func (d *dispatcher) dispatch(ctx context.Context, dv received) bool {
	stream := dv.m.Stream
	if stream == "" {
		select {
		case d.unordered <- dv:
			return true
		case <-ctx.Done():
			return false
		}
	}
	if d.budget != nil {
		select {
		case d.budget <- struct{}{}:
		case <-ctx.Done():
			return false
		}
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
// While a batch runs, the next one is identified beside it when a full
// batch of the same assignment waits (lookAhead). The worker retires once
// its assignment has ended and nothing waits.
func (d *dispatcher) orderedWorker(l *lane) {
	defer d.wg.Done()
	w := &orderedRun{d: d}
	var ahead <-chan *batch
	for {
		if ahead != nil {
			b := <-ahead
			ahead = d.lookAhead(l, w.assignment)
			release := d.p.takeSlot()
			w.execute(b)
			release()
			continue
		}
		dvs := l.next(d.p.cfg.Batch.Size, d.p.linger(), w.assignment)
		if dvs == nil {
			if l.isRetired() {
				select {
				case d.retired <- struct{}{}:
				default:
				}
			}
			return
		}
		d.release(len(dvs))
		for len(dvs) > 0 {
			w.enter(dvs[0].dctx)
			n := 1
			for n < len(dvs) && dvs[n].dctx == w.assignment {
				n++
			}
			if d.p.stopping.Load() {
				// Never started: left unacked, and nothing after them
				// may be acked either.
				d.p.giveUp(d.work, dvs[:n], w.s)
			} else {
				run := dvs[:n]
				release := d.p.takeSlot()
				if n == len(dvs) {
					// What arrived while the worker waited for its slot
					// joins the batch: lanes that outnumber the slots
					// (KeyLanes) run fewer, fuller transactions.
					more := l.takeUpTo(d.p.cfg.Batch.Size-n, w.assignment)
					d.release(len(more))
					run = append(run, more...)
				}
				b := d.p.identifyBatch(d.work, run)
				if n == len(dvs) {
					ahead = d.lookAhead(l, w.assignment)
				}
				w.execute(b)
				release()
			}
			dvs = dvs[n:]
		}
	}
}

// orderedRun is what an ordered worker keeps about its stream's current
// assignment.
type orderedRun struct {
	d          *dispatcher
	assignment context.Context
	s          *settler
	// window counts the messages of the assignment the crash guard still
	// marks.
	window int
}

// enter makes c the current assignment if it is a new one.
func (w *orderedRun) enter(c context.Context) {
	if c != w.assignment {
		w.assignment, w.window, w.s = c, w.d.p.cfg.Batch.Size, &settler{p: w.d.p, ordered: true}
	}
}

// execute runs b, of the current assignment; after the consumer began
// stopping, its messages are abandoned.
func (w *orderedRun) execute(b *batch) {
	if w.d.p.stopping.Load() {
		w.s.abandoned = true
	}
	w.window -= w.d.p.execute(b, w.window > 0, w.s)
}

// lookAhead takes the next batch from l if a full one of assignment
// waits, and identifies it in a goroutine of its own: decoding, ids and
// fingerprints then overlap the transaction of the batch before, on a
// stream that has a backlog. It returns nil when no full batch waits.
func (d *dispatcher) lookAhead(l *lane, assignment context.Context) <-chan *batch {
	size := d.p.cfg.Batch.Size
	if size <= 1 || d.p.stopping.Load() {
		return nil
	}
	dvs := l.takeFull(size, assignment)
	if dvs == nil {
		return nil
	}
	d.release(len(dvs))
	ahead := make(chan *batch, 1)
	go func() { ahead <- d.p.identifyBatch(d.work, dvs) }()
	return ahead
}

// release returns the budget of n deliveries taken from a lane.
func (d *dispatcher) release(n int) {
	if d.budget == nil {
		return
	}
	for range n {
		<-d.budget
	}
}

// unorderedWorker handles the batches the batcher forms of deliveries
// without a stream; a transaction never mixes deliveries of different
// channels.
func (d *dispatcher) unorderedWorker() {
	defer d.wg.Done()
	for batch := range d.batcher.batches {
		started := time.Now()
		suspect := len(batch) == 1 && mayBeRedelivery(batch[0].m)
		// A batch shares one fate, so it must not mix deliveries of
		// different channels: abandoning a batch because one channel died
		// would leave the others' deliveries unacked on a live channel.
		for _, one := range byContext(batch) {
			if d.p.stopping.Load() {
				d.p.giveUp(d.work, one, &settler{p: d.p})
				continue
			}
			d.p.process(d.work, one, false, &settler{p: d.p})
		}
		d.batcher.done(time.Since(started), suspect)
		if d.retireSurplus() {
			return
		}
	}
}

// byContext splits an unordered batch into one batch per delivery context
// (an AMQP channel), each in the order its deliveries came. A source that
// reads several channels at once hands them over interleaved; splitting
// where the context changes would cut such a batch into as many
// transactions as there are changes. A batch of one context is returned
// as it is.
func byContext(batch []received) [][]received {
	first := batch[0].dctx
	same := true
	for _, dv := range batch[1:] {
		if dv.dctx != first {
			same = false
			break
		}
	}
	if same {
		return [][]received{batch}
	}
	var out [][]received
	index := map[context.Context]int{}
	for _, dv := range batch {
		i, ok := index[dv.dctx]
		if !ok {
			i = len(out)
			index[dv.dctx] = i
			out = append(out, nil)
		}
		out[i] = append(out[i], dv)
	}
	return out
}

// linger is how long a worker waits for a batch to fill: Config.
// Batch.Linger, or none when batches are off.
func (p *pipeline) linger() time.Duration {
	if p.cfg.Batch.Size <= 1 {
		return 0
	}
	return p.cfg.Batch.Linger
}
