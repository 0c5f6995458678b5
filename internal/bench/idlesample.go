package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"
)

// idleSampleEvery is how often the backlog phase looks at whether the row
// holds a delivery.
const idleSampleEvery = 10 * time.Millisecond

// idleSampler looks, every idleSampleEvery from the row's first delivery
// until it is stopped, at whether the row held no delivery: every one it
// had received was acked. In the backlog phase a queue full of messages
// waits at the broker all along, so such a moment is time the row spent
// waiting for the broker to deliver, not working. Its share of the samples
// tells a row limited by its broker from one limited by itself.
type idleSampler struct {
	m    *meter
	stop chan struct{}
	done chan struct{}
	once sync.Once

	// samples counts the samples taken, for a look while run goes on.
	samples atomic.Int64
	// held is each sample: when, and how many deliveries the row held
	// (written by run only, read after Stop).
	held []heldSample
}

type heldSample struct {
	at   time.Time
	held int64
}

func startIdleSampler(m *meter) *idleSampler {
	s := &idleSampler{m: m, stop: make(chan struct{}), done: make(chan struct{})}
	go s.run()
	return s
}

func (s *idleSampler) run() {
	defer close(s.done)
	t := time.NewTicker(idleSampleEvery)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		if s.m.firstAt().IsZero() {
			continue
		}
		s.held = append(s.held, heldSample{at: time.Now(), held: s.m.holding()})
		s.samples.Add(1)
	}
}

// Stop ends the sampling and returns the share of the samples (0 to 1) in
// which the row held no delivery; 0 when none was taken.
func (s *idleSampler) Stop() float64 {
	s.once.Do(func() { close(s.stop) })
	<-s.done
	if len(s.held) == 0 {
		return 0
	}
	idle := 0
	for _, h := range s.held {
		if h.held == 0 {
			idle++
		}
	}
	return float64(idle) / float64(len(s.held))
}

// taken returns how many samples were taken so far.
func (s *idleSampler) taken() int64 { return s.samples.Load() }

// writeTimeline writes the samples, after Stop, to path as CSV: ms since
// start, and the deliveries the row held then (received, not yet acked).
// It shows whether a row's idle time is spread over the phase or in a few
// long waits. Errors are ignored: it is a diagnostic.
func (s *idleSampler) writeTimeline(path string, start time.Time) {
	f, err := os.Create(filepath.Clean(path))
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintln(f, "at_ms,held")
	for _, h := range s.held {
		fmt.Fprintf(f, "%.3f,%d\n", float64(h.at.Sub(start))/1e6, h.held)
	}
}
