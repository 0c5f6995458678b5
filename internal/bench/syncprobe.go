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

// syncProbe measures the disk under PostgreSQL while a paced phase runs:
// every syncProbeEvery it writes 8 KiB (a WAL page) to a file of its own
// beside the server's data directory and fdatasyncs it, as a commit
// flushes the WAL. A tail made of every lane's commits slowing at once
// shows here as one slow sync at the same moment; a tail the disk did not
// cause does not.
type syncProbe struct {
	f        *os.File
	stop     chan struct{}
	done     chan struct{}
	stopOnce sync.Once

	mu      sync.Mutex
	samples []syncSample
}

type syncSample struct {
	at   time.Time
	took time.Duration
}

// startSyncProbe starts a probe writing in dir, or returns nil when dir is
// empty (PostgreSQL is not a throwaway server on this machine) or the
// file cannot be made.
func startSyncProbe(dir string) *syncProbe {
	if dir == "" {
		return nil
	}
	f, err := os.CreateTemp(dir, "oncebench-syncprobe-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "oncebench: no disk probe:", err)
		return nil
	}
	p := &syncProbe{f: f, stop: make(chan struct{}), done: make(chan struct{})}
	go p.run()
	return p
}

func (p *syncProbe) run() {
	defer close(p.done)
	page := make([]byte, 8192)
	tick := time.NewTicker(syncProbeEvery)
	defer tick.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-tick.C:
		}
		at := time.Now()
		if _, err := p.f.WriteAt(page, 0); err != nil {
			return
		}
		if err := p.f.Sync(); err != nil {
			return
		}
		p.mu.Lock()
		p.samples = append(p.samples, syncSample{at: at, took: time.Since(at)})
		p.mu.Unlock()
	}
}

// Stop ends the probe, removes its file and returns its samples; nil on a
// nil probe. Later calls return the same samples.
func (p *syncProbe) Stop() []syncSample {
	if p == nil {
		return nil
	}
	p.stopOnce.Do(func() {
		close(p.stop)
		<-p.done
		name := p.f.Name()
		_ = p.f.Close()
		_ = os.Remove(name)
	})
	return p.samples
}

// syncStats returns the p99 and the longest of the syncs that began at
// or after from; zero when there are none.
func syncStats(samples []syncSample, from time.Time) (p99, longest time.Duration) {
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

// writeSyncTimeline writes the probe's samples as CSV: when each sync
// began (ms since start) and how long it took (ms), to set beside the
// paced phase's timeline.
func writeSyncTimeline(path string, samples []syncSample, start time.Time) {
	f, err := os.Create(filepath.Clean(path))
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintln(f, "began_ms,sync_ms")
	for _, s := range samples {
		fmt.Fprintf(f, "%.3f,%.3f\n", float64(s.at.Sub(start))/1e6, float64(s.took)/1e6)
	}
}

// lagProbeEvery is the sleep of the lag probe.
const lagProbeEvery = time.Millisecond

// lagProbe measures, in the consumer's own process, how late a goroutine
// that sleeps lagProbeEvery wakes up: when the cores are taken by the
// broker or the database (a JVM collecting its garbage, a checkpoint),
// every goroutine of the consumer waits as long, and the tail grows by it
// whatever the library does.
type lagProbe struct {
	stop     chan struct{}
	done     chan struct{}
	stopOnce sync.Once
	samples  []syncSample // at: when the sleep began; took: how late it woke
}

func startLagProbe() *lagProbe {
	p := &lagProbe{stop: make(chan struct{}), done: make(chan struct{})}
	go p.run()
	return p
}

func (p *lagProbe) run() {
	defer close(p.done)
	for {
		at := time.Now()
		time.Sleep(lagProbeEvery)
		p.samples = append(p.samples, syncSample{at: at, took: max(0, time.Since(at)-lagProbeEvery)})
		select {
		case <-p.stop:
			return
		default:
		}
	}
}

// Stop ends the probe and returns its samples. Later calls return the
// same samples.
func (p *lagProbe) Stop() []syncSample {
	p.stopOnce.Do(func() {
		close(p.stop)
		<-p.done
	})
	return p.samples
}
