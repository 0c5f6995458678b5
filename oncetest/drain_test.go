package oncetest_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/oncetest"
)

// Drain waits for each message published before it, not for as many acks:
// a message published while it runs (by a handler, say) does not stand in
// for an earlier one that is still waiting for its retry.
func TestDrainWaitsForEachMessagePublishedBeforeIt(t *testing.T) {
	pool := oncetest.Postgres(t)
	// Two streams: "stuck" waits for its retry on one, "chain" and what it
	// publishes run on the other.
	b := memsource.New(memsource.Options{Streams: 2})
	b.Publish(consumer.Message{ID: "stuck", Key: []byte("a"), Value: []byte(`"stuck"`)})
	b.Publish(consumer.Message{ID: "chain", Key: []byte("b"), Value: []byte(`"chain"`)})
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[string]) error {
		switch ev.Payload {
		case "stuck":
			return consumer.RetryAfter(time.Hour, errors.New("not yet"))
		case "chain":
			b.Publish(consumer.Message{ID: "next", Key: []byte("b"), Value: []byte(`"next"`)})
		}
		return nil
	}
	c, err := consumer.New(pool, b.Source(), h, consumer.Config{Name: "drain"})
	require.NoError(t, err)

	defer func(d time.Duration) { oncetest.DrainTimeout = d }(oncetest.DrainTimeout)
	oncetest.DrainTimeout = 3 * time.Second
	failed := oncetest.FatalOf(t, func(tb testing.TB) { oncetest.Drain(tb, c, b) })
	assert.False(t, b.IsAcked(0), "the stuck message was never settled")
	assert.NotEmpty(t, failed, "Drain returned as if every message published before it were settled")
}

// A handler that ignores its context keeps Run from returning: Drain then
// fails the test within its bounds instead of waiting for Run forever.
func TestDrainFailsWhenRunDoesNotStop(t *testing.T) {
	pool := oncetest.Postgres(t)
	b := memsource.New(memsource.Options{})
	b.Publish(consumer.Message{ID: "hang", Value: []byte(`"hang"`)})
	release := make(chan struct{})
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[string]) error {
		<-release // ignores ctx
		return nil
	}
	c, err := consumer.New(pool, b.Source(), h, consumer.Config{Name: "drain", ShutdownTimeout: 100 * time.Millisecond})
	require.NoError(t, err)

	defer func(d time.Duration) { oncetest.DrainTimeout = d }(oncetest.DrainTimeout)
	oncetest.DrainTimeout = time.Second
	var failed string
	returned := make(chan struct{})
	go func() {
		defer close(returned)
		failed = oncetest.FatalOf(t, func(tb testing.TB) { oncetest.Drain(tb, c, b) })
	}()
	select {
	case <-returned:
	case <-time.After(30 * time.Second):
		close(release)
		<-returned
		t.Fatal("Drain waited for a Run that did not return")
	}
	close(release)
	assert.Contains(t, failed, "did not return", "Drain says why it gave up")
}

// drainFailure runs oncetest.Drain on a recorder and returns its failure
// message, "" when it passed.
func drainFailure(t *testing.T, c *consumer.Consumer[string], b *memsource.Broker) string {
	t.Helper()
	return oncetest.FatalOf(t, func(tb testing.TB) { oncetest.Drain(tb, c, b) })
}

// A nil consumer or broker (a setup whose error went unchecked) fails the
// test with a message, not with a panic that ends the test binary.
func TestDrainFailsOnNilArguments(t *testing.T) {
	b := memsource.New(memsource.Options{})
	assert.Contains(t, drainFailure(t, nil, b), "nil consumer")
	pool := oncetest.Postgres(t)
	c, err := consumer.New(pool, b.Source(), func(context.Context, pgx.Tx, consumer.Event[string]) error { return nil },
		consumer.Config{Name: "drain"})
	require.NoError(t, err)
	assert.Contains(t, drainFailure(t, c, nil), "nil broker")
}

// DrainWithin bounds each call by its own argument, so tests that need
// different bounds run in parallel without writing DrainTimeout, a package
// variable the others read (a data race under -race): each fails within
// its own bound, saying which.
func TestDrainWithinBoundsEachCallAlone(t *testing.T) {
	for _, d := range []time.Duration{time.Second, 2 * time.Second} {
		t.Run(d.String(), func(t *testing.T) {
			t.Parallel()
			pool := oncetest.Postgres(t)
			b := memsource.New(memsource.Options{})
			b.Publish(consumer.Message{ID: "hang", Value: []byte(`"hang"`)})
			release := make(chan struct{})
			defer close(release)
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[string]) error {
				<-release // ignores ctx
				return nil
			}
			c, err := consumer.New(pool, b.Source(), h, consumer.Config{Name: "drain", ShutdownTimeout: 100 * time.Millisecond})
			require.NoError(t, err)
			start := time.Now()
			failed := oncetest.FatalOf(t, func(tb testing.TB) { oncetest.DrainWithin(tb, c, b, d) })
			assert.Contains(t, failed, "did not return within "+d.String(), "the failure names the call's own bound")
			assert.GreaterOrEqual(t, time.Since(start), 2*d, "it waited its bound for the messages, then for the stop")
		})
	}
}

// A DrainWithin whose messages settle returns the consumer's stats, like
// Drain, and reads no DrainTimeout that another test may write meanwhile
// (under -race, a read would fail the test); a bound that is not positive
// fails the test.
func TestDrainWithin(t *testing.T) {
	t.Parallel()
	pool := oncetest.Postgres(t)
	b := memsource.New(memsource.Options{})
	b.Publish(consumer.Message{ID: "one", Value: []byte(`"one"`)})
	c, err := consumer.New(pool, b.Source(), func(context.Context, pgx.Tx, consumer.Event[string]) error { return nil },
		consumer.Config{Name: "drain"})
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		// Another test, setting DrainTimeout as it may when not parallel.
		defer wg.Done()
		d := oncetest.DrainTimeout
		oncetest.DrainTimeout = d
	}()
	var stats consumer.Stats
	go func() {
		defer wg.Done()
		stats = oncetest.DrainWithin(t, c, b, time.Minute)
	}()
	wg.Wait()
	assert.Equal(t, uint64(1), stats.Handled)

	failed := oncetest.FatalOf(t, func(tb testing.TB) { oncetest.DrainWithin(tb, c, b, 0) })
	assert.Contains(t, failed, "bound")
}
