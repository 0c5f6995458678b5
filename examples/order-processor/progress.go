package main

import (
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/onceco/once/consumer"
)

// isTerminal reports whether w is a terminal (a character device).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// progress shows a consumer's counters while it runs: one line redrawn in
// place on a terminal, a log line every few seconds otherwise. The rate is
// of messages ended (handled, skipped or dead-lettered) per second.
type progress struct {
	w     io.Writer
	tty   bool
	every time.Duration
	label string
	stats func() consumer.Stats

	stop chan struct{}
	done sync.WaitGroup
}

// startProgress starts reporting stats to w until Stop.
func startProgress(w io.Writer, label string, stats func() consumer.Stats) *progress {
	tty := isTerminal(w)
	every := 5 * time.Second
	if tty {
		every = 200 * time.Millisecond
	}
	return newProgress(w, tty, every, label, stats)
}

// newProgress starts reporting stats to w every interval, in place when tty.
func newProgress(w io.Writer, tty bool, every time.Duration, label string, stats func() consumer.Stats) *progress {
	p := &progress{w: w, tty: tty, every: every, label: label, stats: stats, stop: make(chan struct{})}
	p.done.Add(1)
	go p.loop()
	return p
}

func (p *progress) loop() {
	defer p.done.Done()
	start := time.Now()
	last, lastAt := p.stats(), start
	t := time.NewTicker(p.every)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			s := p.stats()
			if p.tty {
				fmt.Fprintf(p.w, "\r\033[K%s\n", p.line(s, float64(done(s))/time.Since(start).Seconds()))
			}
			return
		case now := <-t.C:
			s := p.stats()
			rate := float64(done(s)-done(last)) / now.Sub(lastAt).Seconds()
			last, lastAt = s, now
			if p.tty {
				fmt.Fprintf(p.w, "\r\033[K%s", p.line(s, rate))
			} else {
				fmt.Fprintf(p.w, "%s %s\n", now.Format("15:04:05"), p.line(s, rate))
			}
		}
	}
}

// done counts the messages that ended: handled, skipped or dead-lettered.
func done(s consumer.Stats) uint64 { return s.Handled + s.Duplicates + s.Skipped + s.DeadLettered }

func (p *progress) line(s consumer.Stats, rate float64) string {
	return fmt.Sprintf("%s received %d  handled %d  duplicates skipped %d  dead-lettered %d  retries %d  %.0f msg/s",
		p.label, s.Received, s.Handled, s.Duplicates, s.DeadLettered, s.Retries, rate)
}

// Stop ends the reporting; on a terminal it leaves the final line.
func (p *progress) Stop() {
	close(p.stop)
	p.done.Wait()
}
