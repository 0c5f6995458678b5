package bench

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/onceco/once/consumer"
)

// HeaderProduced carries a message's produce time (Unix nanoseconds) in
// the paced phase; the meter takes the produce-to-ack latency from it.
const HeaderProduced = "bench-produced"

// meter wraps a consumer.Source: it counts acked deliveries, notes when
// the first delivery arrived, and records the produce-to-ack latency of
// messages that carry HeaderProduced.
type meter struct {
	src   consumer.Source
	first atomic.Int64 // Unix nanoseconds of the first Receive, 0 before
	// received counts the deliveries Receive returned.
	received atomic.Int64
	onFirst  func() // called once, in the Receive goroutine, at the first delivery

	mu      sync.Mutex
	acked   int
	waiters []waiter
	lat     []sample
}

// sample is one paced message's latencies.
type sample struct {
	produced  int64         // Unix nanoseconds
	toAck     time.Duration // produce to ack
	toReceive time.Duration // produce to Receive
}

type waiter struct {
	n  int
	ch chan struct{}
}

func newMeter(src consumer.Source, onFirst func()) *meter {
	return &meter{src: src, onFirst: onFirst, lat: make([]sample, 0, 1<<16)}
}

// Receive implements consumer.Source.
func (m *meter) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := m.src.Receive(ctx)
	if err != nil {
		return nil, err
	}
	if m.first.Load() == 0 {
		if m.onFirst != nil {
			m.onFirst()
		}
		m.first.Store(time.Now().UnixNano())
	}
	m.received.Add(1)
	return &meteredDelivery{Delivery: d, m: m, received: time.Now()}, nil
}

// Close implements consumer.Source.
func (m *meter) Close() error { return m.src.Close() }

// MessagingSystem passes the wrapped source's name on to telemetry.
func (m *meter) MessagingSystem() string {
	if n, ok := m.src.(consumer.SystemNamer); ok {
		return n.MessagingSystem()
	}
	return ""
}

// firstAt is when the first delivery arrived (zero before).
func (m *meter) firstAt() time.Time {
	n := m.first.Load()
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

func (m *meter) acked1(produced int64, received time.Time) {
	now := time.Now()
	m.mu.Lock()
	m.acked++
	if produced > 0 {
		p := time.Unix(0, produced)
		m.lat = append(m.lat, sample{produced: produced, toAck: now.Sub(p), toReceive: received.Sub(p)})
	}
	kept := m.waiters[:0]
	for _, w := range m.waiters {
		if m.acked >= w.n {
			close(w.ch)
		} else {
			kept = append(kept, w)
		}
	}
	m.waiters = kept
	m.mu.Unlock()
}

// Acked returns the number of acked deliveries.
func (m *meter) Acked() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.acked
}

// holding returns how many deliveries were received and not acked yet.
func (m *meter) holding() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.received.Load() - int64(m.acked)
}

// waitAcked blocks until n deliveries were acked or ctx is done.
func (m *meter) waitAcked(ctx context.Context, n int) error {
	m.mu.Lock()
	if m.acked >= n {
		m.mu.Unlock()
		return nil
	}
	ch := make(chan struct{})
	m.waiters = append(m.waiters, waiter{n: n, ch: ch})
	m.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// latencies returns the produce-to-ack and produce-to-Receive latencies of
// the messages produced at or after from, each sorted, and how many
// messages were recorded in all.
func (m *meter) latencies(from time.Time) (toAck, toReceive []time.Duration, all int) {
	m.mu.Lock()
	for _, s := range m.lat {
		if s.produced >= from.UnixNano() {
			toAck, toReceive = append(toAck, s.toAck), append(toReceive, s.toReceive)
		}
	}
	all = len(m.lat)
	m.mu.Unlock()
	slices.Sort(toAck)
	slices.Sort(toReceive)
	return toAck, toReceive, all
}

// writeTimeline writes the paced phase's samples to name as CSV, one line
// a message in the order of their acks: produced (ms since start), produce
// to Receive and produce to ack (ms). It shows whether a tail is one stall
// or spread over the phase. Errors are ignored: it is a diagnostic.
func writeTimeline(name string, m *meter, start time.Time) {
	f, err := os.Create(name)
	if err != nil {
		return
	}
	defer f.Close()
	w := bufio.NewWriter(f)
	defer w.Flush()
	fmt.Fprintln(w, "produced_ms,to_receive_ms,to_ack_ms")
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, s := range m.lat {
		fmt.Fprintf(w, "%.3f,%.3f,%.3f\n", float64(s.produced-start.UnixNano())/1e6,
			float64(s.toReceive)/1e6, float64(s.toAck)/1e6)
	}
}

// meteredDelivery counts its Ack.
type meteredDelivery struct {
	consumer.Delivery
	m        *meter
	received time.Time
}

// Ack implements consumer.Delivery.
func (d *meteredDelivery) Ack(ctx context.Context) error {
	if err := d.Delivery.Ack(ctx); err != nil {
		return err
	}
	var produced int64
	if s, ok := d.Message().Headers[HeaderProduced]; ok {
		produced, _ = strconv.ParseInt(s, 10, 64)
	}
	d.m.acked1(produced, d.received)
	return nil
}

// percentile returns the p-th percentile (0 < p <= 1) of sorted values,
// by the nearest-rank method; 0 for none.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p+0.999999) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}
