//go:build chaos

package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/onceco/once/outbox"
)

// chaosRelayPublisher wraps p with the crash point when relayCrashEnv is
// set.
func chaosRelayPublisher(p outbox.Publisher) outbox.Publisher {
	spec := os.Getenv(relayCrashEnv)
	if spec == "" {
		return p
	}
	_, n, _ := strings.Cut(spec, ":")
	after, err := strconv.ParseInt(n, 10, 64)
	if err != nil || after < 1 {
		after = 1
	}
	c := &crashingPublisher{Publisher: p, after: after}
	if ch, ok := p.(outbox.Checker); ok {
		return checkingCrashingPublisher{c, ch}
	}
	return c
}

// crashingPublisher exits the process after its after-th batch that the
// broker confirmed in full.
type crashingPublisher struct {
	outbox.Publisher
	after   int64
	batches atomic.Int64
}

func (c *crashingPublisher) Publish(ctx context.Context, recs []outbox.Record) []error {
	errs := c.Publisher.Publish(ctx, recs)
	for _, err := range errs {
		if err != nil {
			return errs
		}
	}
	if c.batches.Add(1) == c.after {
		fmt.Fprintf(os.Stderr, "once: chaos crash at %s #%d (%d records confirmed by the broker, not marked sent)\n",
			relayCrashPoint, c.after, len(recs))
		os.Exit(crashExitCode)
	}
	return errs
}

// checkingCrashingPublisher keeps the wrapped publisher's Checker.
type checkingCrashingPublisher struct {
	*crashingPublisher
	checker outbox.Checker
}

func (c checkingCrashingPublisher) Check(rec outbox.Record) error { return c.checker.Check(rec) }
