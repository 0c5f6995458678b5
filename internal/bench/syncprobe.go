package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"
)

// syncProbeEvery is how often the disk probe writes and syncs.
const syncProbeEvery = 10 * time.Millisecond

// lagProbeEvery is the sleep of the lag probe.
const lagProbeEvery = time.Millisecond

// A probe samples, in a goroutine of its own while a paced phase runs, what
// the machine did beside the consumer: startSyncProbe the disk,
// startLagProbe the cores. Stop ends it and returns its samples.
type probe struct {
	// measure takes one sample: how long something took, or how late.
	measure func() (time.Duration, error)
	// every paces the samples; 0 takes them back to back.
	every time.Duration
	// cleanup runs once the probe stopped; may be nil.
	cleanup func()

	stop     chan struct{}
	done     chan struct{}
	stopOnce sync.Once

	mu      sync.Mutex
	samples []probeSample
}

type probeSample struct {
	at   time.Time     // when the sample began
	took time.Duration // how long it took, or how late it woke
}

func startProbe(every time.Duration, measure func() (time.Duration, error), cleanup func()) *probe {
	p := &probe{measure: measure, every: every, cleanup: cleanup, stop: make(chan struct{}), done: make(chan struct{})}
	go p.run()
	return p
}

func (p *probe) run() {
	defer close(p.done)
	var tick <-chan time.Time
	if p.every > 0 {
		t := time.NewTicker(p.every)
		defer t.Stop()
		tick = t.C
	}
	for {
		if tick != nil {
			select {
			case <-p.stop:
				return
			case <-tick:
			}
		}
		at := time.Now()
		took, err := p.measure()
		if err != nil {
			return
		}
		p.mu.Lock()
		p.samples = append(p.samples, probeSample{at: at, took: took})
		p.mu.Unlock()
		if tick == nil {
			select {
			case <-p.stop:
				return
			default:
			}
		}
	}
}

// Stop ends the probe, runs its cleanup and returns its samples; nil on a
// nil probe. Later calls return the same samples.
func (p *probe) Stop() []probeSample {
	if p == nil {
		return nil
	}
	p.stopOnce.Do(func() {
		close(p.stop)
		<-p.done
		if p.cleanup != nil {
			p.cleanup()
		}
	})
	return p.samples
}

// startSyncProbe measures the disk under PostgreSQL: every syncProbeEvery
// it writes 8 KiB (a WAL page) to a file of its own in dir, beside the
// server's data directory, and fdatasyncs it, as a commit flushes the WAL.
// A tail made of every lane's commits slowing at once shows here as one
// slow sync at the same moment; a tail the disk did not cause does not.
// It returns nil when dir is empty (PostgreSQL is not a throwaway server
// on this machine) or the file cannot be made.
func startSyncProbe(dir string) *probe {
	if dir == "" {
		return nil
	}
	f, err := os.CreateTemp(dir, "oncebench-syncprobe-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "oncebench: no disk probe:", err)
		return nil
	}
	page := make([]byte, 8192)
	return startProbe(syncProbeEvery, func() (time.Duration, error) {
		start := time.Now()
		if _, err := f.WriteAt(page, 0); err != nil {
			return 0, err
		}
		if err := f.Sync(); err != nil {
			return 0, err
		}
		return time.Since(start), nil
	}, func() {
		name := f.Name()
		_ = f.Close()
		_ = os.Remove(name)
	})
}

// startLagProbe measures, in the consumer's own process, how late a
// goroutine that sleeps lagProbeEvery wakes up: when the cores are taken
// by the broker or the database (a JVM collecting its garbage, a
// checkpoint), every goroutine of the consumer waits as long, and the tail
// grows by it whatever the library does.
func startLagProbe() *probe {
	return startProbe(0, func() (time.Duration, error) {
		start := time.Now()
		time.Sleep(lagProbeEvery)
		return max(0, time.Since(start)-lagProbeEvery), nil
	}, nil)
}

// probeStats returns the p99 and the longest of the samples that began at
// or after from; zero when there are none.
func probeStats(samples []probeSample, from time.Time) (p99, longest time.Duration) {
	var took []time.Duration
	for _, s := range samples {
		if !s.at.Before(from) {
			took = append(took, s.took)
		}
	}
	if len(took) == 0 {
		return 0, 0
	}
	slices.Sort(took)
	return percentile(took, 0.99), took[len(took)-1]
}

// writeProbeTimeline writes a probe's samples as CSV: when each began (ms
// since start) and how long it took or how late it woke (ms), to set
// beside the paced phase's timeline.
func writeProbeTimeline(path string, samples []probeSample, start time.Time) {
	f, err := os.Create(filepath.Clean(path))
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintln(f, "began_ms,took_ms")
	for _, s := range samples {
		fmt.Fprintf(f, "%.3f,%.3f\n", float64(s.at.Sub(start))/1e6, float64(s.took)/1e6)
	}
}
