package bench

import (
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

	samples, idle atomic.Int64
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
		if s.m.holding() == 0 {
			s.idle.Add(1)
		}
		s.samples.Add(1)
	}
}

// Stop ends the sampling and returns the share of the samples (0 to 1) in
// which the row held no delivery; 0 when none was taken.
func (s *idleSampler) Stop() float64 {
	s.once.Do(func() { close(s.stop) })
	<-s.done
	if s.samples.Load() == 0 {
		return 0
	}
	return float64(s.idle.Load()) / float64(s.samples.Load())
}

// taken returns how many samples were taken so far.
func (s *idleSampler) taken() int64 { return s.samples.Load() }
