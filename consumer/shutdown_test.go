package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// silentDatabase returns a pool on the test database whose connections
// pass through a proxy, and a function that makes the database go silent:
// the connections stay up and nothing the pool sends reaches the server (a
// network partition, a frozen server), and one that makes it answer again
// (also called when the test ends). configure, when not nil, is applied
// to the pool's configuration.
func silentDatabase(t *testing.T, configure func(*pgxpool.Config)) (pool *pgxpool.Pool, goSilent, answer func()) {
	t.Helper()
	_, schema := pgtest.Schema(t)
	pool, proxy := pgtest.NewPoolThroughProxy(t, schema, configure)
	var mu sync.Mutex
	var paused bool
	goSilent = func() {
		mu.Lock()
		defer mu.Unlock()
		if !paused {
			proxy.Pause()
			paused = true
		}
	}
	answer = func() {
		mu.Lock()
		defer mu.Unlock()
		if paused {
			proxy.Resume()
			paused = false
		}
	}
	t.Cleanup(answer) // before the proxy closes
	return pool, goSilent, answer
}

// runUntilStopped runs c and returns a function that cancels Run's context
// and reports whether Run returned within limit. When the test ends,
// before is called and Run waited for.
func runUntilStopped(t *testing.T, c *consumer.Consumer[order], before func()) (stop func(limit time.Duration) bool) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var returned bool
	t.Cleanup(func() {
		cancel()
		before()
		if !returned {
			if err := <-done; err != nil {
				t.Logf("Run after the test: %v", err)
			}
		}
	})
	return func(limit time.Duration) bool {
		cancel()
		select {
		case err := <-done:
			returned = true
			require.NoError(t, err)
			return true
		case <-time.After(limit):
			return false
		}
	}
}

// silentAfterDeadLetter wraps a source: once a dead letter of one of its
// deliveries is written, the database goes silent.
type silentAfterDeadLetter struct {
	consumer.Source
	goSilent func()
}

type silentDeadLetterDelivery struct {
	consumer.Delivery
	goSilent func()
}

func (s *silentAfterDeadLetter) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return &silentDeadLetterDelivery{Delivery: d, goSilent: s.goSilent}, nil
}

func (d *silentDeadLetterDelivery) DeadLetter(ctx context.Context, dl *consumer.DeadLetter) error {
	err := d.Delivery.DeadLetter(ctx, dl)
	d.goSilent()
	return err
}

// silentAfterRollback is a pgx tracer that makes the database go silent
// once an armed rollback has been answered.
type silentAfterRollback struct {
	armed    atomic.Bool
	goSilent func()
}

func (s *silentAfterRollback) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (s *silentAfterRollback) TraceQueryEnd(_ context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	if strings.EqualFold(data.CommandTag.String(), "ROLLBACK") && s.armed.Load() {
		s.goSilent()
	}
}

// PostgreSQL stops answering (the connections stay up, no reply comes
// back: a network partition, a frozen server) while the consumer has a
// statement of its own to send outside a message's transaction: the
// rollback of a failed transaction, the removal of a dead-lettered
// message's crash-guard record, the give-back of a suspect's attempt. Run's
// context is then cancelled: Run must return within about
// Config.ShutdownTimeout, leaving the message unacked, instead of waiting
// for the database for as long as it stays silent.
func TestShutdownTimeoutBoundsRunWhenTheDatabaseGoesSilent(t *testing.T) {
	const limit = 5 * time.Second
	cfg := fastConfig("silent-database")
	cfg.ShutdownTimeout = 200 * time.Millisecond
	v, _ := json.Marshal(order{N: 1})

	t.Run("rollback", func(t *testing.T) {
		pool, goSilent, answer := silentDatabase(t, nil)
		b := memsource.New(memsource.Options{Streams: 1})
		publish(b, "e1", 1)
		failed := make(chan struct{})
		h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
			goSilent()
			close(failed)
			return errors.New("rejected")
		}
		c, err := consumer.New(pool, b.Source(), h, cfg)
		require.NoError(t, err)
		stop := runUntilStopped(t, c, answer)
		<-failed
		require.True(t, stop(limit), "Run still waits for the silent database %s after ShutdownTimeout (%s)", limit, cfg.ShutdownTimeout)
		require.Zero(t, b.Acked())
	})

	t.Run("dead letter's crash-guard record", func(t *testing.T) {
		pool, goSilent, answer := silentDatabase(t, nil)
		b := memsource.New(memsource.Options{Streams: 1})
		publish(b, "e1", 1) // among the first of the stream: the crash guard marks it
		h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
			return consumer.Permanent(errors.New("rejected"))
		}
		c, err := consumer.New(pool, &silentAfterDeadLetter{Source: b.Source(), goSilent: goSilent}, h, cfg)
		require.NoError(t, err)
		stop := runUntilStopped(t, c, answer)
		require.Eventually(t, func() bool { return len(b.DeadLetters()) == 1 }, 10*time.Second, time.Millisecond)
		require.True(t, stop(limit), "Run still waits for the silent database %s after ShutdownTimeout (%s)", limit, cfg.ShutdownTimeout)
	})

	t.Run("suspect's attempt", func(t *testing.T) {
		tracer := &silentAfterRollback{}
		pool, goSilent, answer := silentDatabase(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
		tracer.goSilent = goSilent
		b := memsource.New(memsource.Options{Streams: 1})
		// Redelivered: a suspect, whose attempt is recorded as a crash until
		// it ends.
		b.Publish(consumer.Message{Value: v, Headers: map[string]string{"id": "e1"}, Key: []byte("e1"), Redelivered: true})
		failed := make(chan struct{})
		h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
			tracer.armed.Store(true)
			close(failed)
			return errors.New("rejected")
		}
		c, err := consumer.New(pool, b.Source(), h, cfg)
		require.NoError(t, err)
		stop := runUntilStopped(t, c, answer)
		<-failed
		require.True(t, stop(limit), "Run still waits for the silent database %s after ShutdownTimeout (%s)", limit, cfg.ShutdownTimeout)
		require.Zero(t, b.Acked())
	})
}

// silentAfterMark is a pgx tracer that, once the crash guard has marked
// the first messages of a stream, makes the database go silent and calls
// then.
type silentAfterMark struct {
	once     sync.Once
	goSilent func()
	then     func()
}

type markQuery struct{}

func (s *silentAfterMark) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(data.SQL, "WITH marked AS") {
		return context.WithValue(ctx, markQuery{}, true)
	}
	return ctx
}

func (s *silentAfterMark) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	if ctx.Value(markQuery{}) != nil && data.Err == nil {
		s.once.Do(func() { s.goSilent(); s.then() })
	}
}

// Messages the crash guard marked (the first of a stream) and abandoned
// before their transaction began (the consumer began stopping) have their
// marks taken back, best effort. On a database that stopped answering,
// that give-back must end at the shutdown deadline too, not after
// Config.InfraBackoff.Max for each message, one after another.
func TestShutdownTimeoutBoundsTakingBackMarksOnASilentDatabase(t *testing.T) {
	const limit = 5 * time.Second
	cfg := fastConfig("silent-database-marks")
	cfg.ShutdownTimeout = 200 * time.Millisecond
	cfg.InfraBackoff.Max = 2 * limit
	tracer := &silentAfterMark{}
	pool, goSilent, answer := silentDatabase(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
	tracer.goSilent = goSilent
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e1", 1)
	effects(t, pool)
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	marked := make(chan struct{})
	tracer.then = func() { consumer.BeginStopping(c); close(marked) }
	stop := runUntilStopped(t, c, answer)
	<-marked
	require.True(t, stop(limit), "Run still waits for the silent database %s after ShutdownTimeout (%s)", limit, cfg.ShutdownTimeout)
	require.Zero(t, b.Acked())
}

// cutOnSecondLookup is a pgx tracer that cuts the database connections as
// the crash guard's second lookup of records starts, and calls then.
type cutOnSecondLookup struct {
	lookups atomic.Int32
	cut     func()
	then    func()
}

func (s *cutOnSecondLookup) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(data.SQL, "SELECT event_id, attempts, crashes, last_error FROM") && s.lookups.Add(1) == 2 {
		s.cut()
		s.then()
	}
	return ctx
}

func (s *cutOnSecondLookup) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// A suspect's attempt never starts once the consumer began stopping: it
// would run with no crash recorded for it, in a transaction begun after
// the shutdown began. Here the lookup of its record, just before the
// attempt, fails on a lost connection, and the shutdown begins during the
// backoff before its retry.
func TestSuspectAttemptDoesNotStartWhenStoppingCutsItsLookupShort(t *testing.T) {
	_, schema := pgtest.Schema(t)
	tracer := &cutOnSecondLookup{}
	pool, proxy := pgtest.NewPoolThroughProxy(t, schema, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
	tracer.cut = func() { proxy.Cut() }
	effects(t, pool)
	b := memsource.New(memsource.Options{}) // unordered, like AMQP
	v, _ := json.Marshal(order{N: 1})
	b.Publish(consumer.Message{Value: v, Headers: map[string]string{"id": "e1"}, Redelivered: true})
	var calls atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		calls.Add(1)
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("suspect-stopping")
	cfg.InfraBackoff = consumer.Backoff{Initial: time.Minute, Max: time.Minute} // the shutdown comes first
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	cut := make(chan struct{})
	tracer.then = func() { consumer.BeginStopping(c); close(cut) }
	stop := start(t, c)
	<-cut
	require.NoError(t, stop())
	assert.Equal(t, int32(2), tracer.lookups.Load(), "the plan's lookup, then the attempt's")
	assert.Zero(t, calls.Load(), "the suspect's handler ran after the shutdown began")
	assert.Zero(t, b.Acked())
}
