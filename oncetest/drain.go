package oncetest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
)

// DrainTimeout bounds Drain: a consumer that has not settled every message
// by then (a handler that hangs, a database that is down) fails the test.
// It bounds the stop too: a Run that has not returned within DrainTimeout
// of being stopped (a handler that ignores its context) fails the test.
// Drain reads it once, when called. Tests that run in parallel must not
// change it (a data race with the Drain of another test): give such a test
// its own bound with DrainWithin.
var DrainTimeout = time.Minute

// Drain runs c until every message published to b so far is settled (acked:
// handled, skipped as a duplicate, or dead-lettered), then stops it and
// returns its Stats. It fails the test when Run returns an error, or
// returns nil before Drain stops it (Run ends on its own only when it
// fails), or when the messages are not settled within DrainTimeout, or
// when Run does not return within DrainTimeout of being stopped. c must read from a
// Source of b, and Run must not have been called on it.
func Drain[T any](t testing.TB, c *consumer.Consumer[T], b *memsource.Broker) consumer.Stats {
	t.Helper()
	return drain(t, "Drain", c, b, DrainTimeout)
}

// DrainWithin is Drain bounded by d instead of DrainTimeout: the messages
// must be settled within d, and Run must return within d of being stopped.
// It reads no package variable, so tests that need bounds of their own may
// run in parallel. A d that is not positive fails the test.
func DrainWithin[T any](t testing.TB, c *consumer.Consumer[T], b *memsource.Broker, d time.Duration) consumer.Stats {
	t.Helper()
	return drain(t, "DrainWithin", c, b, d)
}

// drain is Drain and DrainWithin (name) with the bound d.
func drain[T any](t testing.TB, name string, c *consumer.Consumer[T], b *memsource.Broker, d time.Duration) consumer.Stats {
	t.Helper()
	if c == nil {
		t.Fatalf("oncetest: %s: nil consumer", name)
	}
	if b == nil {
		t.Fatalf("oncetest: %s: nil broker", name)
	}
	if d <= 0 {
		t.Fatalf("oncetest: %s: the bound %v is not positive", name, d)
	}
	return drainRun(t, c.Run, c.Stats, b, d)
}

// drainRun is drain of the consumer whose Run and Stats are run and stats.
func drainRun(t testing.TB, run func(context.Context) error, stats func() consumer.Stats, b *memsource.Broker, d time.Duration) consumer.Stats {
	t.Helper()
	published := b.Published()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan runEnd, 1)
	go func() {
		err := run(ctx)
		done <- runEnd{err: err, early: ctx.Err() == nil}
	}()
	wait, stopWaiting := context.WithTimeout(context.Background(), d)
	defer stopWaiting()
	waitErr := waitOrEnd(wait, b, published, done)
	cancel()
	var end runEnd
	stopped := time.NewTimer(d)
	defer stopped.Stop()
	select {
	case end = <-done:
	case <-stopped.C:
		if waitErr == nil {
			waitErr = errors.New("every message settled")
		}
		t.Fatalf("oncetest: Run did not return within %v of being stopped (a handler that ignores its context?); %v (stats %+v)", d, waitErr, stats())
	}
	if end.err != nil {
		t.Fatalf("oncetest: Run: %v", end.err)
	}
	if end.early {
		t.Fatalf("oncetest: Run returned nil before it was stopped (its context had not ended), with %d of the %d messages published before Drain acked (stats %+v)",
			ackedOf(b, published), published, stats())
	}
	if waitErr != nil {
		t.Fatalf("oncetest: %v (stats %+v)", waitErr, stats())
	}
	return stats()
}

// runEnd is how Run returned: its error, and whether its context was still
// live then (Run returned on its own, not stopped by Drain).
type runEnd struct {
	err   error
	early bool
}

// ackedOf is how many of the first n messages of b are acked.
func ackedOf(b *memsource.Broker, n int) int {
	acked := 0
	for i := range n {
		if b.IsAcked(int64(i)) {
			acked++
		}
	}
	return acked
}

// waitOrEnd waits until each of the first n messages of b is acked, unless
// Run ends first. Acks of messages published meanwhile (by a handler, say)
// do not stand in for those.
func waitOrEnd(ctx context.Context, b *memsource.Broker, n int, done chan runEnd) error {
	acked := make(chan error, 1)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { acked <- b.WaitEachAcked(wctx, n) }()
	select {
	case err := <-acked:
		return err
	case end := <-done:
		done <- end // for Drain to read
		return nil
	}
}
