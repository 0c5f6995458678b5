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
// returns its Stats. It fails the test when Run returns an error, or when
// the messages are not settled within DrainTimeout, or when Run does not
// return within DrainTimeout of being stopped. c must read from a
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
	published := b.Published()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	wait, stopWaiting := context.WithTimeout(context.Background(), d)
	defer stopWaiting()
	waitErr := waitOrEnd(wait, b, published, done)
	cancel()
	var runErr error
	stopped := time.NewTimer(d)
	defer stopped.Stop()
	select {
	case runErr = <-done:
	case <-stopped.C:
		if waitErr == nil {
			waitErr = errors.New("every message settled")
		}
		t.Fatalf("oncetest: Run did not return within %v of being stopped (a handler that ignores its context?); %v (stats %+v)", d, waitErr, c.Stats())
	}
	if runErr != nil {
		t.Fatalf("oncetest: Run: %v", runErr)
	}
	if waitErr != nil {
		t.Fatalf("oncetest: %v (stats %+v)", waitErr, c.Stats())
	}
	return c.Stats()
}

// waitOrEnd waits until each of the first n messages of b is acked, unless
// Run ends first. Acks of messages published meanwhile (by a handler, say)
// do not stand in for those.
func waitOrEnd(ctx context.Context, b *memsource.Broker, n int, done chan error) error {
	acked := make(chan error, 1)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { acked <- b.WaitEachAcked(wctx, n) }()
	select {
	case err := <-acked:
		return err
	case err := <-done:
		done <- err // for Drain to read
		return nil
	}
}
