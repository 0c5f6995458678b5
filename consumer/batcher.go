package consumer

import (
	"sync/atomic"
	"time"
)

// groupCommitRunning is how many unordered transactions may run while a
// batch that is not full closes without waiting. Past it a partial batch
// keeps filling until a transaction ends (or it has waited as long as a
// transaction takes): the deliveries that arrive meanwhile would only wait
// for a connection and the cores anyway, and in one transaction they cost
// PostgreSQL one claim, one commit and one WAL flush instead of one each.
// One, measured on RabbitMQ against 2, 4 and 16 (docs/performance.md):
// fuller batches (60-80 messages per transaction against 30-40 with two
// and 12-17 with sixteen, the old behaviour) and the shortest tail. Full
// batches still run on every worker at once.
const groupCommitRunning = 1

// maxGroupWait bounds how long a partial batch waits for a running
// transaction to end, whatever the transactions' recent duration: a
// handler retrying for seconds must not hold up the messages behind it.
const maxGroupWait = 20 * time.Millisecond

// batcher forms the batches of deliveries without a stream (RabbitMQ,
// unordered) in one goroutine and hands them to the unordered workers.
//
// A batch closes when it is full, when a worker is free and fewer than
// groupCommitRunning transactions run, or when it has waited as long as a
// recent transaction took (at most maxGroupWait; maxGroupWait before the
// first transaction ended). So a light stream is
// handled a message at a time with no wait, and a heavy one in full
// batches, with no fixed linger in between (Config.Batch.Linger, when set,
// replaces the last two rules by its fixed wait). Forming batches in one
// place, instead of each worker taking what waits when it is free, keeps
// the stream from being split into as many small batches as there are
// workers.
type batcher struct {
	d *dispatcher
	// batches carries closed batches to the workers; unbuffered, so a
	// send succeeds only when a worker is free.
	batches chan []received
	// running counts batches handed to workers and not finished yet, but
	// for those waiting aside (asideFor).
	running atomic.Int32
	// finished holds a token when a worker finished a batch since the
	// batcher last looked.
	finished chan struct{}
	// txNanos is a moving average of how long a batch took to handle.
	txNanos atomic.Int64
}

func newBatcher(d *dispatcher) *batcher {
	return &batcher{d: d, batches: make(chan []received), finished: make(chan struct{}, 1)}
}

// run forms batches from in until it is closed and everything taken from
// it was handed over, then closes batches.
func (b *batcher) run(in <-chan received) {
	defer close(b.batches)
	size := b.d.p.cfg.Batch.Size
	var cur []received
	var opened time.Time // when cur's first delivery arrived
	wait := time.NewTimer(time.Hour)
	wait.Stop()
	defer wait.Stop()
	for in != nil || len(cur) > 0 {
		var out chan<- []received
		var recv <-chan received
		var timeout <-chan time.Time
		if len(cur) < size {
			recv = in
		}
		if len(cur) > 0 {
			if left, ok := b.mayClose(len(cur), opened, in == nil); ok {
				out = b.batches
			} else {
				wait.Reset(left)
				timeout = wait.C
			}
		}
		select {
		case dv, ok := <-recv:
			if !ok {
				in = nil
				break
			}
			if mayBeRedelivery(dv.m) {
				// A suspect is handled alone, after what came before it,
				// so that its attempts hold up only its worker.
				b.hand(cur)
				b.hand([]received{dv})
				cur = nil
				break
			}
			if len(cur) == 0 {
				opened = time.Now()
				cur = make([]received, 0, min(size, 16))
			}
			cur = append(cur, dv)
		case out <- cur:
			b.running.Add(1)
			cur = nil
		case <-b.finished:
		case <-timeout:
		}
		if timeout != nil && !wait.Stop() {
			select {
			case <-wait.C:
			default:
			}
		}
	}
}

// mayClose reports whether a batch of n deliveries, whose first arrived at
// opened, may go to the next free worker; if not, left is how long until
// it may regardless of the running transactions.
func (b *batcher) mayClose(n int, opened time.Time, drained bool) (left time.Duration, ok bool) {
	if n >= b.d.p.cfg.Batch.Size || drained {
		return 0, true
	}
	limit := b.d.p.cfg.Batch.Linger
	if limit <= 0 {
		if b.running.Load() < groupCommitRunning {
			return 0, true
		}
		limit = maxGroupWait
		if avg := time.Duration(b.txNanos.Load()); avg > 0 {
			limit = min(avg, maxGroupWait)
		}
	}
	left = limit - time.Since(opened)
	return left, left <= 0
}

// hand gives batch, if not empty, to the next free worker.
func (b *batcher) hand(batch []received) {
	if len(batch) > 0 {
		b.batches <- batch
		b.running.Add(1)
	}
}

// asideFor takes a batch that begins waiting aside (pipeline.aside) out
// of the running ones, and puts it back when its wait ends (waits false):
// a batch waiting for its retry, perhaps an hour, runs no transaction, and
// counted as running it made every partial batch meanwhile wait up to
// maxGroupWait for nothing.
func (b *batcher) asideFor(waits bool) {
	if !waits {
		b.running.Add(1)
		return
	}
	b.running.Add(-1)
	b.wake()
}

// wake tells the batcher that fewer batches run.
func (b *batcher) wake() {
	select {
	case b.finished <- struct{}{}:
	default:
	}
}

// done records that a worker finished a batch that took took; suspects
// (handled alone, perhaps retried for long) are left out of the average.
func (b *batcher) done(took time.Duration, suspect bool) {
	if !suspect {
		// An exponential moving average with weight 1/8 for the last.
		// Concurrent updates may lose one sample, which only delays the
		// average a little.
		old := b.txNanos.Load()
		b.txNanos.Store(old + (int64(took)-old)/8)
	}
	b.running.Add(-1)
	b.wake()
}
