package consumer_test

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtemp"
	"github.com/onceco/once/internal/pgtest"
)

// checkedAck wraps a source so that every Ack first checks, from another
// connection, that the message's claim is committed: guarantee 2, ack after
// commit.
type checkedAck struct {
	consumer.Source
	pool   *pgxpool.Pool
	early  atomic.Int32
	checks atomic.Int32
}

type checkedDelivery struct {
	consumer.Delivery
	s *checkedAck
}

func (s *checkedAck) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return &checkedDelivery{Delivery: d, s: s}, nil
}

func (d *checkedDelivery) Ack(ctx context.Context) error {
	var n int
	err := d.s.pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE event_id = $1`,
		d.Message().Headers["id"]).Scan(&n)
	if err != nil || n != 1 {
		d.s.early.Add(1)
	}
	d.s.checks.Add(1)
	return d.Delivery.Ack(ctx)
}

func TestAckOnlyAfterCommit(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 2})
	for i := 0; i < 40; i++ {
		publish(b, fmt.Sprintf("e%d", i%30), i%30)
	}
	src := &checkedAck{Source: b.Source(), pool: pool}
	c, err := consumer.New(pool, src, insertEffect, fastConfig("ack-after-commit"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 40 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, int32(40), src.checks.Load())
	assert.Zero(t, src.early.Load(), "an ack came before its claim was committed")
}

func TestIDConflictIsDeadLettered(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "same-id", 1)
	publish(b, "same-id", 1) // true duplicate
	publish(b, "same-id", 2) // same id, other payload
	var calls atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		calls.Add(1)
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("conflict"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 3 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, int32(1), calls.Load(), "the handler never runs for a duplicate or a conflict")
	assert.Equal(t, map[string]int{"same-id": 1}, countEffects(t, pool))
	dl := b.DeadLetters()
	require.Len(t, dl, 1)
	h2 := dl[0].Headers
	assert.Equal(t, string(consumer.KindIDConflict), h2[consumer.HeaderErrorKind])
	assert.Len(t, h2[consumer.HeaderFingerprint], 64)
	assert.Len(t, h2[consumer.HeaderOriginalFingerprint], 64)
	assert.NotEqual(t, h2[consumer.HeaderFingerprint], h2[consumer.HeaderOriginalFingerprint])
	assert.NotEmpty(t, h2[consumer.HeaderOriginalProcessedAt])
	assert.Equal(t, `{"n":2}`, string(dl[0].Message.Value))
	st := c.Stats()
	assert.Equal(t, uint64(1), st.Duplicates)
	assert.Equal(t, uint64(1), st.DeadLettered)
}

func TestIDConflictSkipPolicyAndNoFingerprint(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  func(*consumer.Config)
	}{
		{"skip", func(c *consumer.Config) { c.Identify.OnConflict = consumer.SkipConflicts }},
		{"no-fingerprint", func(c *consumer.Config) { c.Identify.Fingerprint = consumer.NoFingerprint }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "same-id", 1)
			publish(b, "same-id", 2)
			cfg := fastConfig("conflict-" + tc.name)
			tc.cfg(&cfg)
			c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
			require.NoError(t, err)
			start(t, c)
			require.Eventually(t, func() bool { return b.Acked() == 2 }, 10*time.Second, 5*time.Millisecond)
			assert.Equal(t, map[string]int{"same-id": 1}, countEffects(t, pool))
			assert.Empty(t, b.DeadLetters())
		})
	}
}

// A message whose handling never finishes (standing for one that crashes
// the process) is abandoned by each consumer in turn; after
// CrashGuard.MaxCrashes crashes alone the next consumer dead-letters it instead
// of trying. Run 1 crashes in a batch shared with "fine", which charges no
// crash to either; runs 2 and 3 run the killer isolated.
func TestCrashLoopIsDeadLettered(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "killer", 1)
	publish(b, "fine", 2)
	stuck := make(chan struct{}, 16)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "killer" {
			stuck <- struct{}{}
			<-ctx.Done() // never returns by itself: the process "dies" here
			return ctx.Err()
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("crash-loop")
	cfg.CrashGuard.MaxCrashes = 2
	cfg.ShutdownTimeout = 10 * time.Millisecond
	for run := 1; run <= 4; run++ {
		c, err := consumer.New(pool, b.Source(), h, cfg)
		require.NoError(t, err)
		stop := start(t, c)
		if run <= 3 {
			select {
			case <-stuck:
			case <-time.After(10 * time.Second):
				t.Fatalf("run %d: the handler was not called", run)
			}
			require.NoError(t, stop())
			assert.False(t, b.IsAcked(0), "an abandoned message is never acked")
			continue
		}
		require.Eventually(t, func() bool { return b.Acked() == 2 }, 10*time.Second, 5*time.Millisecond)
		require.NoError(t, stop())
	}
	dl := b.DeadLetters()
	require.Len(t, dl, 1)
	assert.Equal(t, string(consumer.KindCrashLoop), dl[0].Headers[consumer.HeaderErrorKind])
	assert.Equal(t, "3", dl[0].Headers[consumer.HeaderAttempts], "the handler ran three times, each cut short")
	assert.Equal(t, map[string]int{"fine": 1}, countEffects(t, pool))
	var left int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_events_attempts`).Scan(&left))
	assert.Zero(t, left, "attempt counts are cleared once the message is settled")
}

func TestDeadLetterFailureBlocksAck(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1})
	b.Publish(consumer.Message{Value: []byte("not json"), Headers: map[string]string{"id": "poison"}})
	b.SetDeadLetterError(errors.New("dead-letter queue unavailable"))
	c, err := consumer.New(pool, b.Source(), insertEffect, fastConfig("dlq-down"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return c.Stats().InfraErrors >= 3 }, 10*time.Second, 5*time.Millisecond)
	assert.False(t, b.IsAcked(0), "no ack while the dead letter is not written")
	assert.Empty(t, b.DeadLetters())
	b.SetDeadLetterError(nil)
	require.Eventually(t, func() bool { return b.IsAcked(0) }, 10*time.Second, 5*time.Millisecond)
	assert.Len(t, b.DeadLetters(), 1)
}

func TestRetryAfterAndPermanent(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "later", 1)
	publish(b, "never", 2)
	var laterCalls atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		switch ev.ID {
		case "later":
			if laterCalls.Add(1) == 1 {
				return consumer.RetryAfter(time.Millisecond, errors.New("not ready"))
			}
			assert.Equal(t, 2, ev.Attempt)
		case "never":
			return consumer.Permanent(errors.New("invalid order"))
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("outcomes"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 2 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, map[string]int{"later": 1}, countEffects(t, pool))
	dl := b.DeadLetters()
	require.Len(t, dl, 1)
	assert.Equal(t, "1", dl[0].Headers[consumer.HeaderAttempts], "a permanent error is not retried")
	assert.Contains(t, dl[0].Headers[consumer.HeaderErrorMessage], "invalid order")
}

// RetryAfter is the handler's request for another attempt after its delay,
// counted against MaxAttempts, also around a PostgreSQL error that alone
// would be an infrastructure failure (a deadlock, a serialization
// failure): the message is dead-lettered once its attempts are spent,
// each after the delay it asked for.
func TestRetryAfterAroundATransientSQLStateCountsAttempts(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "deadlocked", 1)
	const wait = 30 * time.Millisecond
	var mu sync.Mutex
	var calls []time.Time
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		mu.Lock()
		calls = append(calls, time.Now())
		mu.Unlock()
		_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01'; END $$`)
		assert.Error(t, err) // not require: the handler runs in the consumer's goroutine
		return consumer.RetryAfter(wait, err)
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("retry-after-deadlock"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 5*time.Second, 5*time.Millisecond,
		"the message is dead-lettered after Retry.MaxAttempts")
	dl := b.DeadLetters()
	require.Len(t, dl, 1)
	assert.Equal(t, "3", dl[0].Headers[consumer.HeaderAttempts])
	assert.Equal(t, "40P01", dl[0].Headers[consumer.HeaderErrorSQLState])
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, calls, 3)
	for i := 1; i < len(calls); i++ {
		assert.GreaterOrEqual(t, calls[i].Sub(calls[i-1]), wait, "attempt %d came %v after a RetryAfter(%v)", i+1, calls[i].Sub(calls[i-1]), wait)
	}
}

func TestHandlerTimeoutCountsAsFailure(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "slow", 1)
	cfg := fastConfig("timeout")
	cfg.HandlerTimeout = 20 * time.Millisecond
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		<-ctx.Done()
		return ctx.Err()
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, 5*time.Millisecond)
	dl := b.DeadLetters()
	require.Len(t, dl, 1)
	assert.Equal(t, string(consumer.KindHandler), dl[0].Headers[consumer.HeaderErrorKind])
	assert.Contains(t, dl[0].Headers[consumer.HeaderErrorMessage], "HandlerTimeout")
}

// A handler is bounded by default: one that hangs ignoring nothing but its
// context would otherwise hold its stream (and, on RabbitMQ, its delivery
// past the broker's 30 minute consumer_timeout) for ever. HandlerTimeout -1
// lifts the bound.
func TestHandlerTimeoutDefaultsToAMinute(t *testing.T) {
	for name, tc := range map[string]struct {
		timeout time.Duration
		bounded bool
	}{"default": {0, true}, "unbounded": {-1, false}} {
		t.Run(name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "one", 1)
			cfg := fastConfig("deadline")
			cfg.HandlerTimeout = tc.timeout
			deadlines := make(chan time.Duration, 1)
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				d, ok := ctx.Deadline()
				if !ok {
					deadlines <- -1
					return nil
				}
				deadlines <- time.Until(d)
				return nil
			}
			c, err := consumer.New(pool, b.Source(), h, cfg)
			require.NoError(t, err)
			start(t, c)
			left := <-deadlines
			if !tc.bounded {
				assert.Equal(t, time.Duration(-1), left, "the handler's context has a deadline")
				return
			}
			assert.Greater(t, left, 50*time.Second)
			assert.LessOrEqual(t, left, consumer.DefaultHandlerTimeout)
			assert.Equal(t, time.Minute, consumer.DefaultHandlerTimeout)
		})
	}
}

// Stopping PostgreSQL mid-stream: nothing is acked or dead-lettered while
// it is down, and once it is back every event has its effect exactly once.
func TestDatabaseStoppedMidStream(t *testing.T) {
	for name, h := range map[string]consumer.Handler[order]{"exec": insertEffect, "queued": queueEffect} {
		t.Run(name, func(t *testing.T) { databaseStoppedMidStream(t, h) })
	}
}

// databaseStoppedMidStream stops the database under a consumer whose
// handler is h: nothing is acked or dead-lettered while it is down, and
// every effect is there once after it is back.
func databaseStoppedMidStream(t *testing.T, h consumer.Handler[order]) {
	ctx := context.Background()
	srv, err := pgtemp.Start(ctx, pgtemp.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })
	pool, err := pgxpool.New(ctx, srv.URL())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	effects(t, pool)

	// Half the events are published before the stop and half after it:
	// the consumer may well finish the first half before the stop lands,
	// and the second half is the work that is sure to meet a database that
	// is down.
	const total = 400
	b := memsource.New(memsource.Options{Streams: 4})
	for i := 0; i < total/2; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("db-down"))
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return b.Acked() >= 50 }, 20*time.Second, 5*time.Millisecond)

	require.NoError(t, srv.Stop(ctx))
	for i := total / 2; i < total; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	require.Eventually(t, func() bool { return c.Stats().InfraErrors >= 8 }, 20*time.Second, 5*time.Millisecond)
	ackedWhileDown := b.Acked()
	require.Eventually(t, func() bool { return c.Stats().InfraErrors >= 16 }, 20*time.Second, 5*time.Millisecond)
	assert.Equal(t, ackedWhileDown, b.Acked(), "nothing may be acked while the database is down")
	assert.Empty(t, b.DeadLetters(), "an infrastructure failure is not poison")

	require.NoError(t, srv.Restart(ctx))
	require.Eventually(t, func() bool { return b.Acked() == total }, 60*time.Second, 10*time.Millisecond)
	require.NoError(t, stop())
	requireEffectsOnce(t, pool, total)
	assert.Empty(t, b.DeadLetters())
}

func TestNewValidatesConfig(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	src := memsource.New(memsource.Options{}).Source()
	cases := map[string]struct {
		cfg   consumer.Config
		field string
	}{
		"no name":              {consumer.Config{}, "Name"},
		"long name":            {consumer.Config{Name: string(make([]byte, 201))}, "Name"},
		"negative concurrency": {consumer.Config{Name: "x", Concurrency: -1}, "Concurrency"},
		"negative attempts":    {consumer.Config{Name: "x", Retry: consumer.RetryPolicy{MaxAttempts: -1}}, "Retry.MaxAttempts"},
		"negative timeout":     {consumer.Config{Name: "x", ShutdownTimeout: -time.Second}, "ShutdownTimeout"},
		"negative handler":     {consumer.Config{Name: "x", HandlerTimeout: -2}, "HandlerTimeout"},
		"negative backoff":     {consumer.Config{Name: "x", InfraBackoff: consumer.Backoff{Max: -1}}, "InfraBackoff.Max"},
		"unknown policy":       {consumer.Config{Name: "x", Identify: consumer.IdentifyConfig{OnConflict: 7}}, "Identify.OnConflict"},
		"negative retention":   {consumer.Config{Name: "x", Retention: consumer.RetentionConfig{MaxAge: -time.Hour}}, "Retention.MaxAge"},
		"duty cycle above one": {consumer.Config{Name: "x", Retention: consumer.RetentionConfig{DutyCycle: 1.5}}, "Retention.DutyCycle"},
		// A window in nanoseconds (MaxAge: 24, meant as hours) was
		// accepted: every sweep deleted the claims as they were
		// committed, and every redelivery was handled again.
		"retention window in nanoseconds": {consumer.Config{Name: "x", Retention: consumer.RetentionConfig{MaxAge: 24}}, "Retention.MaxAge"},
		"retention window under a second": {consumer.Config{Name: "x", Retention: consumer.RetentionConfig{MaxAge: time.Second - 1}}, "Retention.MaxAge"},
		// An interval in nanoseconds (Interval: 60, meant as minutes)
		// was accepted: the sweeps ran back to back, three statements
		// each, on the database for as long as the consumer ran.
		"retention interval in nanoseconds": {consumer.Config{Name: "x", Retention: consumer.RetentionConfig{MaxAge: time.Hour, Interval: 60}}, "Retention.Interval"},
		// NaN fails every comparison: a range check written as "d < 0 ||
		// d > 1" let it through, and every retention sweep then failed.
		"duty cycle NaN": {consumer.Config{Name: "x", Retention: consumer.RetentionConfig{DutyCycle: math.NaN()}}, "Retention.DutyCycle"},
		// A nil middleware (one left unset, say, when tracing is off) was
		// accepted, and every handler call then panicked through it:
		// every message was dead-lettered as a panic.
		"nil middleware": {consumer.Config{Name: "x", Hooks: consumer.Hooks{Middleware: []consumer.Middleware{nil}}}, "Hooks.Middleware[0]"},
		// The name is the consumer column of every claim and
		// crash-guard record: text that PostgreSQL refuses failed every
		// statement, retried without end as an infrastructure failure,
		// and nothing was consumed.
		// math.MaxInt, meant as no bound, was accepted, and Run then
		// panicked making a channel of that many slots.
		"receive buffer beyond its bound": {consumer.Config{Name: "x", ReceiveBuffer: math.MaxInt}, "ReceiveBuffer"},
		"receive buffer over a million":   {consumer.Config{Name: "x", ReceiveBuffer: 1<<20 + 1}, "ReceiveBuffer"},
		// math.MaxInt or 1<<30, meant as no bound, was accepted, and Run
		// then started a goroutine for each (a few kilobytes apiece) at
		// its start: terabytes, the process killed for its memory.
		"concurrency beyond its bound":              {consumer.Config{Name: "x", Concurrency: math.MaxInt}, "Concurrency"},
		"concurrency over PostgreSQL's connections": {consumer.Config{Name: "x", Concurrency: 1 << 18}, "Concurrency"},
		"NUL in the name":                           {consumer.Config{Name: "or\x00ders"}, "Name"},
		"name not UTF-8":                            {consumer.Config{Name: "orders\xff"}, "Name"},
		// A Store not made by dedup.New (new(dedup.Store)) has no table
		// names nor statements: it was accepted, and Run panicked with
		// a nil dereference migrating it, ending the process at start.
		"store not made by dedup.New": {consumer.Config{Name: "x", Store: &dedup.Store{}}, "Store"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := consumer.New(pool, src, insertEffect, tc.cfg)
			require.ErrorIs(t, err, consumer.ErrInvalidConfig)
			assert.Contains(t, err.Error(), tc.field)
		})
	}
	_, err := consumer.New[order](pool, src, nil, consumer.Config{Name: "x"})
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	_, err = consumer.New(nil, src, insertEffect, consumer.Config{Name: "x"})
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	_, err = consumer.New(pool, nil, insertEffect, consumer.Config{Name: "x"})
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	// A source whose Open failed, its error dropped (src, err := ...;
	// c, err := consumer.New(pool, src, ...)), is a nil pointer in a
	// non-nil Source: it was accepted, and Run failed with a panic's
	// stack as the source breaking its contract.
	var failed *memsource.Source
	_, err = consumer.New(pool, failed, insertEffect, consumer.Config{Name: "x"})
	require.ErrorIs(t, err, consumer.ErrInvalidConfig, "a nil *memsource.Source")
	_, err = consumer.New(pool, src, insertEffect, consumer.Config{Name: "x", Concurrency: 1<<18 - 1})
	require.NoError(t, err, "as many transactions as PostgreSQL's connections may be")
	_, err = consumer.New(pool, src, insertEffect, consumer.Config{Name: "x", Retention: consumer.RetentionConfig{MaxAge: time.Second}})
	require.NoError(t, err, "a retention window of a second is accepted")
	_, err = consumer.New(pool, src, insertEffect, consumer.Config{Name: "x", Retention: consumer.RetentionConfig{MaxAge: time.Hour, Interval: time.Millisecond}})
	require.NoError(t, err, "a retention interval of a millisecond is accepted")
}

// A duration in the wrong unit (HandlerTimeout: 30, meant as seconds, is
// 30 ns) was accepted: every handler call was cut before its first
// statement and every message dead-lettered as a HandlerTimeout failure;
// with DatabaseTimeout every step of the consumer's was cut and nothing
// was consumed, retried as infrastructure without end; with
// Retention.Interval sweeps ran back to back; with a backoff (MaxBackoff:
// 10, meant as seconds) a handler's retries were spent within microseconds
// and an outage's infrastructure retries spun, a warning logged for each.
// New refuses each, naming the field, as it refuses a Retention.MaxAge
// below a second.
func TestNewRefusesDurationsBelowAMillisecond(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	src := memsource.New(memsource.Options{}).Source()
	cases := map[string]struct {
		set   func(*consumer.Config, time.Duration)
		field string
	}{
		"HandlerTimeout":       {func(c *consumer.Config, d time.Duration) { c.HandlerTimeout = d }, "HandlerTimeout"},
		"DatabaseTimeout":      {func(c *consumer.Config, d time.Duration) { c.DatabaseTimeout = d }, "DatabaseTimeout"},
		"Retention.Interval":   {func(c *consumer.Config, d time.Duration) { c.Retention.Interval = d }, "Retention.Interval"},
		"Retry.MaxBackoff":     {func(c *consumer.Config, d time.Duration) { c.Retry.MaxBackoff = d }, "Retry.MaxBackoff"},
		"Retry.InitialBackoff": {func(c *consumer.Config, d time.Duration) { c.Retry.InitialBackoff = d }, "Retry.InitialBackoff"},
		"InfraBackoff.Max":     {func(c *consumer.Config, d time.Duration) { c.InfraBackoff.Max = d }, "InfraBackoff.Max"},
		"InfraBackoff.Initial": {func(c *consumer.Config, d time.Duration) { c.InfraBackoff.Initial = d }, "InfraBackoff.Initial"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			for _, d := range []time.Duration{30, time.Millisecond - 1} {
				cfg := consumer.Config{Name: "x"}
				tc.set(&cfg, d)
				_, err := consumer.New(pool, src, insertEffect, cfg)
				require.ErrorIs(t, err, consumer.ErrInvalidConfig, "%s %v", tc.field, d)
				assert.Contains(t, err.Error(), tc.field)
			}
			cfg := consumer.Config{Name: "x"}
			tc.set(&cfg, time.Millisecond)
			_, err := consumer.New(pool, src, insertEffect, cfg)
			require.NoError(t, err, "a millisecond is accepted")
		})
	}
}

// ReceiveBuffer defaults to 2 × Concurrency × Batch.Size: a large
// Batch.Size (1<<40, meant as no bound) made a default Run could not make a
// channel of, and Run panicked, crashing the process. The default stops at
// ReceiveBuffer's bound.
func TestHugeBatchSizeRuns(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "a", 1)
	cfg := fastConfig("huge-batch")
	cfg.Batch.Size = 1 << 40
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, map[string]int{"a": 1}, countEffects(t, pool))
}

// A database that cannot be reached at the start is waited for (it may be
// restarting), and a Run that ctx ends meanwhile returns the failure,
// naming the consumer and the address: not nil, as if it had stopped.
func TestRunFailsClearlyWhenDatabaseUnreachable(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=2")
	require.NoError(t, err)
	defer pool.Close()
	c, err := consumer.New(pool, memsource.New(memsource.Options{}).Source(), insertEffect, consumer.Config{Name: "db-check"})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	err = c.Run(ctx)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "db-check")
	assert.Contains(t, err.Error(), "127.0.0.1:1")
}

// An event id is part of the primary keys of processed_events and of the
// crash guard's table, (consumer, event_id): PostgreSQL's btree refuses a
// key past about 2,700 bytes, and it would refuse it on every retry. New
// refuses an Identify.MaxIDLength that lets such ids through (it once took
// any, and an id of 3,000 bytes then failed its claim forever as an
// infrastructure failure, its stream stuck behind it); an id at the limit,
// under the longest Name, is handled, and a longer one is dead-lettered
// invalid-id.
func TestMaxIDLengthFitsTheKey(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	_, err := consumer.New(pool, b.Source(), insertEffect,
		consumer.Config{Name: "x", Identify: consumer.IdentifyConfig{MaxIDLength: 10000}})
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "Identify.MaxIDLength")

	const limit = 2048
	id := func(n int) string { // random, so that nothing compresses it
		raw := make([]byte, n/2)
		_, _ = crand.Read(raw)
		return hex.EncodeToString(raw)
	}
	atLimit, past := id(limit), id(limit+2)
	publish(b, "before", 1)
	publish(b, atLimit, 2)
	publish(b, past, 3)
	publish(b, "after", 4)
	cfg := fastConfig(strings.Repeat("n", 200))
	cfg.Identify.MaxIDLength = limit
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 4 }, 20*time.Second, 5*time.Millisecond)
	got := requireEffectsOnce(t, pool, 3)
	assert.Contains(t, got, atLimit)
	assert.Equal(t, string(consumer.KindInvalidID), deadLetterOf(t, b, past).Headers[consumer.HeaderErrorKind])
}

// failingSource fails every Receive: a fatal error of the source.
type failingSource struct{}

func (failingSource) Receive(context.Context) (consumer.Delivery, error) {
	return nil, errors.New("broker gone")
}
func (failingSource) Close() error { return nil }

// Run returns a fatal source error while its context is still live (the
// service goes on, and may start another consumer): nothing of the
// consumer may go on with it, retention included, which would otherwise
// keep deleting rows on the pool every Interval, one more goroutine for
// each consumer restarted this way.
func TestNothingOutlivesRunAfterAFatalSourceError(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	cfg := fastConfig("fatal-source")
	cfg.Retention = consumer.RetentionConfig{MaxAge: time.Hour, Interval: 10 * time.Millisecond}
	c, err := consumer.New(pool, failingSource{}, insertEffect, cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	require.ErrorContains(t, c.Run(ctx), "broker gone")
	buf := make([]byte, 1<<20)
	stacks := string(buf[:runtime.Stack(buf, true)])
	assert.NotContains(t, stacks, "consumer.(*pipeline).retention", "retention outlived Run")
}

type created struct {
	Order string `json:"order"`
}
type paid struct {
	Order  string `json:"order"`
	Amount int    `json:"amount"`
}

func TestRouterDispatchesByType(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE log (event_id text, what text)`)
	require.NoError(t, err)
	write := func(ctx context.Context, tx pgx.Tx, id, what string) error {
		_, err := tx.Exec(ctx, `INSERT INTO log VALUES ($1, $2)`, id, what)
		return err
	}
	for _, policy := range []consumer.UnknownTypePolicy{consumer.DeadLetterUnknownTypes, consumer.SkipUnknownTypes} {
		r := consumer.NewRouter[any](consumer.RouterConfig{UnknownTypes: policy})
		require.NoError(t, consumer.Handle(r, "order.created", func(ctx context.Context, tx pgx.Tx, ev consumer.Event[created]) error {
			return write(ctx, tx, ev.ID, "created "+ev.Payload.Order)
		}))
		require.NoError(t, consumer.Handle(r, "order.paid", func(ctx context.Context, tx pgx.Tx, ev consumer.Event[paid]) error {
			return write(ctx, tx, ev.ID, fmt.Sprintf("paid %s %d", ev.Payload.Order, ev.Payload.Amount))
		}))
		err := consumer.Handle(r, "order.paid", func(ctx context.Context, tx pgx.Tx, ev consumer.Event[paid]) error { return nil })
		require.ErrorIs(t, err, consumer.ErrInvalidConfig, "registering a type twice is an error")
		assert.Equal(t, []string{"order.created", "order.paid"}, r.Types())

		b := memsource.New(memsource.Options{Streams: 1})
		pub := func(id, typ string, v any) {
			raw, _ := json.Marshal(v)
			b.Publish(consumer.Message{Value: raw, Headers: map[string]string{"id": id, "type": typ}})
		}
		p := fmt.Sprint(policy)
		pub("c1"+p, "order.created", created{Order: "o1"})
		pub("p1"+p, "order.paid", paid{Order: "o1", Amount: 5})
		pub("x1"+p, "order.shipped", created{Order: "o1"})
		b.Publish(consumer.Message{Value: []byte("{"), Headers: map[string]string{"id": "bad" + p, "type": "order.paid"}})
		c, err := consumer.NewRouted(pool, b.Source(), r, fastConfig("router-"+p))
		require.NoError(t, err)
		stop := start(t, c)
		require.Eventually(t, func() bool { return b.Acked() == 4 }, 10*time.Second, 5*time.Millisecond)
		require.NoError(t, stop())

		var whats []string
		rows, err := pool.Query(context.Background(), `SELECT what FROM log WHERE event_id LIKE '%'||$1 ORDER BY what`, p)
		require.NoError(t, err)
		whats, err = pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		assert.Equal(t, []string{"created o1", "paid o1 5"}, whats)
		kinds := map[string]string{}
		for _, d := range b.DeadLetters() {
			kinds[d.Headers[consumer.HeaderEventID]] = d.Headers[consumer.HeaderErrorKind]
		}
		want := map[string]string{"bad" + p: string(consumer.KindDecode)}
		if policy == consumer.DeadLetterUnknownTypes {
			want["x1"+p] = string(consumer.KindUnknownType)
		} else {
			assert.Equal(t, uint64(1), c.Stats().Skipped)
		}
		assert.Equal(t, want, kinds)
	}
	_, err = consumer.NewRouted(pool, memsource.New(memsource.Options{}).Source(), consumer.NewRouter[any](consumer.RouterConfig{}), fastConfig("empty"))
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
}

// Handler failures inside batches: the batch is split, every other
// message's effect commits exactly once, order within the stream holds,
// and a message that always fails is dead-lettered after MaxAttempts.
func TestBatchFailureSplitsAndKeepsOrder(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	const total = 300
	b := memsource.New(memsource.Options{Streams: 1})
	for i := 0; i < total; i++ {
		publish(b, fmt.Sprintf("e%03d", i), i)
	}
	var mu sync.Mutex
	calls := map[int]int{}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if err := insertEffect(ctx, tx, ev); err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		calls[ev.Payload.N]++
		switch {
		case ev.Payload.N%97 == 0: // always fails
			return errors.New("always fails")
		case ev.Payload.N%13 == 0 && calls[ev.Payload.N] == 1: // fails once
			return errors.New("transient business failure")
		}
		return nil
	}
	cfg := fastConfig("batch-split")
	cfg.Batch.Size = 50
	cfg.Batch.Linger = 20 * time.Millisecond
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == total }, 20*time.Second, 5*time.Millisecond)

	got := countEffects(t, pool)
	for i := 0; i < total; i++ {
		id := fmt.Sprintf("e%03d", i)
		if i%97 == 0 {
			assert.Zero(t, got[id], "a dead-lettered message has no effect")
			continue
		}
		assert.Equal(t, 1, got[id], "effect of %s", id)
	}
	assert.Len(t, b.DeadLetters(), 4) // 0, 97, 194, 291
	for _, n := range []int{0, 97, 194, 291} {
		assert.Equal(t, 3, calls[n], "MaxAttempts counts the failure inside the batch")
	}
	rows, err := pool.Query(context.Background(), `SELECT n FROM effects ORDER BY seq`)
	require.NoError(t, err)
	ns, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	require.NoError(t, err)
	for i := 1; i < len(ns); i++ {
		require.Less(t, ns[i-1], ns[i], "commit order must follow the stream's order")
	}
	assert.Greater(t, c.Stats().Handled, uint64(0))
}

// A message that cannot be handled (here: not JSON) in the middle of an
// ordered batch does not split the batch: the messages around it commit in
// one transaction, and it is dead-lettered in its place among the acks,
// after the messages before it and before those after it.
func TestPoisonInABatchDoesNotSplitIt(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	const total = 10
	for i := 0; i < total; i++ {
		if i == 4 {
			b.Publish(consumer.Message{Value: []byte("not json"), Headers: map[string]string{"id": "e4"}})
			continue
		}
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	var mu sync.Mutex
	var log commitLog
	var settled []string
	cfg := fastConfig("poison-no-split")
	cfg.Batch.Size = total
	cfg.Batch.Linger = time.Minute // the batch closes when all ten are queued
	cfg.Hooks.AfterCommit = log.hook
	cfg.Hooks.OnOutcome = func(_ context.Context, o consumer.Outcome) {
		mu.Lock()
		settled = append(settled, o.EventID+":"+string(o.Result))
		mu.Unlock()
	}
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	require.NoError(t, b.WaitAcked(context.Background(), total))

	requireEffectsOnce(t, pool, total-1)
	require.Len(t, b.DeadLetters(), 1)
	assert.Equal(t, string(consumer.KindDecode), b.DeadLetters()[0].Headers[consumer.HeaderErrorKind])
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, [][]string{{"e0", "e1", "e2", "e3", "e5", "e6", "e7", "e8", "e9"}}, log.transactions(),
		"one transaction for the messages around the poison")
	assert.Equal(t, []string{"e0:handled", "e1:handled", "e2:handled", "e3:handled", "e4:dead_lettered",
		"e5:handled", "e6:handled", "e7:handled", "e8:handled", "e9:handled"}, settled, "settled in stream order")
}

// A handler that swallows a failed statement's error, or commits the
// consumer's transaction itself, is a handler failure, not an
// infrastructure failure that would retry forever.
func TestHandlerMisusingTheTransaction(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "swallows", 1)
	publish(b, "commits", 2)
	publish(b, "fine", 3)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		switch ev.ID {
		case "swallows":
			_, _ = tx.Exec(ctx, `INSERT INTO no_such_table VALUES (1)`)
			return nil
		case "commits":
			if err := insertEffect(ctx, tx, ev); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("misuse")
	cfg.Batch.Size = 1
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 3 }, 10*time.Second, 5*time.Millisecond)
	kinds := map[string]string{}
	for _, d := range b.DeadLetters() {
		kinds[d.Headers[consumer.HeaderEventID]] = d.Headers[consumer.HeaderErrorKind]
	}
	assert.Equal(t, map[string]string{"swallows": "handler", "commits": "handler"}, kinds)
	assert.Equal(t, 1, countEffects(t, pool)["fine"])
}

// A handler failing with a network error of its own (an HTTP dependency
// down) is a handler failure: retried, then dead-lettered. Only database
// failures under the transaction pause the stream indefinitely.
func TestHandlerNetworkErrorIsNotInfrastructure(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "calls-http", 1)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		return fmt.Errorf("calling the payment provider: %w",
			&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED})
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("http-down"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, 5*time.Millisecond)
	dl := b.DeadLetters()
	require.Len(t, dl, 1)
	assert.Equal(t, string(consumer.KindHandler), dl[0].Headers[consumer.HeaderErrorKind])
	assert.Equal(t, "3", dl[0].Headers[consumer.HeaderAttempts])
	assert.Zero(t, c.Stats().InfraErrors)
}

// Several redelivered messages after a crash: only the one that really
// crashes the process each time accumulates crash attempts; innocent
// messages redelivered with it are handled, not dead-lettered.
func TestCrashLoopSparesInnocentNeighbours(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{}) // unordered, like AMQP
	publish(b, "killer", 0)
	for i := 1; i <= 5; i++ {
		publish(b, fmt.Sprintf("innocent-%d", i), i)
	}
	stuck := make(chan struct{}, 64)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "killer" {
			stuck <- struct{}{}
			<-ctx.Done() // the process "dies" here
			return ctx.Err()
		}
		select { // innocent work takes a while: it is in flight when the process dies
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("crash-neighbours")
	cfg.CrashGuard.MaxCrashes = 2
	cfg.ShutdownTimeout = 10 * time.Millisecond
	cfg.Concurrency = 8
	cfg.Batch.Size = 1 // one message per worker: all in flight at once
	// Run 1: every message is in flight at once; the killer "crashes".
	for run := 1; run <= 4; run++ {
		c, err := consumer.New(pool, b.Source(), h, cfg)
		require.NoError(t, err)
		stop := start(t, c)
		if run <= 3 {
			select {
			case <-stuck:
			case <-time.After(10 * time.Second):
				t.Fatalf("run %d: the killer was not handled", run)
			}
			require.NoError(t, stop())
			continue
		}
		require.Eventually(t, func() bool { return b.Acked() == 6 }, 10*time.Second, 5*time.Millisecond)
		require.NoError(t, stop())
	}
	kinds := map[string]string{}
	for _, d := range b.DeadLetters() {
		kinds[d.Headers[consumer.HeaderEventID]] = d.Headers[consumer.HeaderErrorKind]
	}
	assert.Equal(t, map[string]string{"killer": string(consumer.KindCrashLoop)}, kinds)
	got := countEffects(t, pool)
	for i := 1; i <= 5; i++ {
		assert.Equal(t, 1, got[fmt.Sprintf("innocent-%d", i)])
	}
}

// A handler in a batch that commits or rolls back the consumer's
// transaction itself fails alone: the transaction it shares with the rest
// of the batch stays the consumer's, so the messages after it in the batch
// are handled once (a handler's COMMIT took their claims along before
// their handlers ran: they were skipped as duplicates, their effects
// lost), and the misuser's own writes are rolled back with its failure.
func TestHandlerEndingTheBatchTransactionLosesNoNeighbour(t *testing.T) {
	for _, end := range []string{"commit", "rollback"} {
		t.Run(end, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			for i := range 6 {
				publish(b, fmt.Sprintf("e%d", i), i)
			}
			var endErr atomic.Value
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				if err := insertEffect(ctx, tx, ev); err != nil {
					return err
				}
				if ev.ID != "e2" {
					return nil
				}
				var err error
				if end == "commit" {
					err = tx.Commit(ctx)
				} else {
					err = tx.Rollback(ctx)
				}
				endErr.Store(fmt.Sprint(err))
				return nil // the handler goes on as if its commit were the consumer's
			}
			c, err := consumer.New(pool, b.Source(), h, fastConfig("ends-tx-"+end))
			require.NoError(t, err)
			start(t, c)
			require.Eventually(t, func() bool { return b.Acked() == 6 }, 10*time.Second, 5*time.Millisecond)
			got := countEffects(t, pool)
			assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e3": 1, "e4": 1, "e5": 1}, got,
				"every other message of the batch has its effect once; the misuser's is rolled back")
			dl := b.DeadLetters()
			require.Len(t, dl, 1)
			assert.Equal(t, "e2", dl[0].Headers[consumer.HeaderEventID])
			assert.Equal(t, string(consumer.KindHandler), dl[0].Headers[consumer.HeaderErrorKind])
			assert.Contains(t, dl[0].Headers[consumer.HeaderErrorMessage], "transaction")
			assert.Contains(t, endErr.Load(), "consumer", "the handler's own call is refused with a clear error")
		})
	}
}

// A handler in a batch that ends the consumer's transaction with a
// statement of its own (COMMIT, END, ROLLBACK, ABORT through tx.Exec) is
// dead-lettered, and every other message of its batch has its effect once:
// the claims a raw COMMIT made durable before their handlers ran are not
// taken for a finished handling.
func TestHandlerEndingTheBatchTransactionWithSQLLosesNoNeighbour(t *testing.T) {
	for _, end := range []string{"COMMIT", "END", "ROLLBACK", "ABORT"} {
		t.Run(end, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			for i := range 6 {
				publish(b, fmt.Sprintf("e%d", i), i)
			}
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				if err := insertEffect(ctx, tx, ev); err != nil {
					return err
				}
				if ev.ID != "e2" {
					return nil
				}
				_, err := tx.Exec(ctx, end)
				return err
			}
			c, err := consumer.New(pool, b.Source(), h, fastConfig("ends-tx-sql-"+strings.ToLower(end)))
			require.NoError(t, err)
			start(t, c)
			require.Eventually(t, func() bool { return b.Acked() == 6 }, 10*time.Second, 5*time.Millisecond)
			got := countEffects(t, pool)
			if end == "COMMIT" || end == "END" {
				// Its own COMMIT made its writes durable; nothing can take
				// them back.
				delete(got, "e2")
			}
			assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e3": 1, "e4": 1, "e5": 1}, got,
				"every other message of the batch has its effect once")
			dl := b.DeadLetters()
			require.Len(t, dl, 1)
			assert.Equal(t, "e2", dl[0].Headers[consumer.HeaderEventID])
			assert.Equal(t, string(consumer.KindHandler), dl[0].Headers[consumer.HeaderErrorKind])
			assert.Contains(t, dl[0].Headers[consumer.HeaderErrorMessage], "transaction")
		})
	}
}

// The claims a handler's own COMMIT made durable for the messages after it
// are taken back also when the deliveries are lost at that moment (a
// closed channel, a revoked partition): the redelivered messages run then,
// instead of being skipped as duplicates.
func TestHandlerEndingTheBatchTransactionAsItsDeliveryIsLostLosesNoNeighbour(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := range 6 {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	src := b.Source()
	lost := make(chan struct{})
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if err := insertEffect(ctx, tx, ev); err != nil {
			return err
		}
		if ev.ID == "e2" && !ev.Message.Redelivered {
			// assert, not require: the handler runs in the consumer's
			// goroutine, where FailNow would end it, not the test.
			_, err := tx.Exec(ctx, "COMMIT")
			assert.NoError(t, err)
			assert.NoError(t, src.Close()) // the deliveries are lost
			close(lost)
		}
		return nil
	}
	cfg := fastConfig("ends-tx-sql-lost")
	first, err := consumer.New(pool, src, h, cfg)
	require.NoError(t, err)
	stop := start(t, first)
	select {
	case <-lost:
	case <-time.After(10 * time.Second):
		t.Fatal("e2 was not handled")
	}
	_ = stop()
	second, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, second)
	require.Eventually(t, func() bool { return b.Acked() == 6 }, 10*time.Second, 5*time.Millisecond)
	got := countEffects(t, pool)
	delete(got, "e2") // its own COMMIT made its writes durable
	assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e3": 1, "e4": 1, "e5": 1}, got,
		"every other message of the batch has its effect once")
}

// A handler that ends the consumer's transaction and begins one of its own
// (COMMIT, then BEGIN) is caught as one that ended it: the statements it
// sends after its COMMIT are refused, so the messages after it never run
// in a transaction that no longer holds their claims, and none of them is
// lost when a later one fails.
func TestHandlerBeginningATransactionOfItsOwnLosesNoNeighbour(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := range 6 {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	var beginErr atomic.Value
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		switch ev.ID {
		case "e4":
			return consumer.Permanent(errors.New("invalid"))
		case "e2":
			if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "BEGIN")
			beginErr.Store(fmt.Sprint(err))
			if err != nil {
				return nil // the handler goes on as if its BEGIN had worked
			}
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("begins-own-tx"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 6 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e3": 1, "e5": 1}, countEffects(t, pool),
		"every message but the two that failed has its effect once")
	assert.Equal(t, map[string]string{"e2": string(consumer.KindHandler), "e4": string(consumer.KindHandler)}, deadLetterKinds(b))
	assert.Contains(t, beginErr.Load(), "transaction", "the statement after the handler's COMMIT is refused, saying why")
}

// A handler that ends the consumer's transaction and opens another in the
// same statement (COMMIT; BEGIN in one Exec, sent with the simple
// protocol, or COMMIT AND CHAIN) leaves its connection in a transaction:
// it is caught as one that ended the transaction all the same. Its COMMIT
// made the claims of the messages after it durable; they are taken back,
// so that none of them is lost when a later message of the batch fails and
// the transaction the handler opened is rolled back.
func TestHandlerEndingTheBatchTransactionAndOpeningAnotherLosesNoNeighbour(t *testing.T) {
	for _, end := range []string{"COMMIT; BEGIN", "COMMIT AND CHAIN", "/* ; */ END; START TRANSACTION", "ROLLBACK; BEGIN"} {
		t.Run(end, func(t *testing.T) {
			endTheBatchTransaction(t, end, func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, end)
				return err
			})
		})
	}
}

// endTheBatchTransaction runs six messages in one batch: e2's handler
// writes its effect, then ends the transaction with end (sent by send), e4
// fails for good. Every other message must have its effect once, e2 and
// e4 be dead-lettered as handler failures, and e2's own writes stay once
// if end committed them.
func endTheBatchTransaction(t *testing.T, end string, send func(ctx context.Context, tx pgx.Tx) error) {
	t.Helper()
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := range 6 {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		switch ev.ID {
		case "e4":
			return consumer.Permanent(errors.New("invalid"))
		case "e2":
			if err := insertEffect(ctx, tx, ev); err != nil {
				return err
			}
			return send(ctx, tx)
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("ends-and-opens-tx")
	cfg.Batch.Linger = time.Second // one batch of all six
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 6 }, 10*time.Second, 5*time.Millisecond)
	got := countEffects(t, pool)
	if strings.HasPrefix(end, "ROLLBACK") {
		assert.Zero(t, got["e2"], "its ROLLBACK took its writes back")
	} else {
		assert.Equal(t, 1, got["e2"], "what its own COMMIT wrote stays, once")
	}
	delete(got, "e2")
	assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e3": 1, "e5": 1}, got,
		"every message but the two that failed has its effect once")
	assert.Equal(t, map[string]string{"e2": string(consumer.KindHandler), "e4": string(consumer.KindHandler)}, deadLetterKinds(b))
}

// A statement a handler queues that ends the transaction (Event.Queue of
// COMMIT, END, ROLLBACK or ABORT) is that handler's failure, not that of
// the handler whose statement is sent next: the queuing message is
// dead-lettered, and the message whose tx.Exec sent the queue first runs
// again and has its effect once. When the others queue their statements
// too, those queued after it are not sent outside the transaction: their
// messages run again and have their effects once.
func TestQueuedStatementEndingTheBatchTransactionIsChargedToItsHandler(t *testing.T) {
	for _, tc := range []struct{ end, others string }{
		{"COMMIT", "exec"}, {"END", "exec"}, {"ROLLBACK", "exec"}, {"ABORT", "exec"},
		{"COMMIT", "queue"}, {"ROLLBACK", "queue"},
	} {
		end := tc.end
		t.Run(end+"/"+tc.others, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			for i := range 6 {
				publish(b, fmt.Sprintf("e%d", i), i)
			}
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				if ev.ID == "e2" {
					ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N)
					ev.Queue(end)
					return nil
				}
				if tc.others == "queue" {
					ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N)
					return nil
				}
				return insertEffect(ctx, tx, ev)
			}
			cfg := fastConfig("queues-end-" + strings.ToLower(end))
			cfg.Batch.Linger = time.Second // one batch of all six
			c, err := consumer.New(pool, b.Source(), h, cfg)
			require.NoError(t, err)
			start(t, c)
			require.Eventually(t, func() bool { return b.Acked() == 6 }, 10*time.Second, 5*time.Millisecond)
			got := countEffects(t, pool)
			if end == "COMMIT" || end == "END" {
				assert.Equal(t, 1, got["e2"], "what its own COMMIT wrote stays, once")
				delete(got, "e2")
			}
			assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e3": 1, "e4": 1, "e5": 1}, got,
				"every other message of the batch has its effect once")
			assert.Equal(t, map[string]string{"e2": string(consumer.KindHandler)}, deadLetterKinds(b))
		})
	}
}

// A handler that rolls its batch's transaction back with a ROLLBACK of its
// own left no claim to take back: a claim another consumer committed
// meanwhile for a message after it in the batch (a copy of it handled
// elsewhere) stays, and that message is skipped as the duplicate it is.
func TestHandlerRollingBackTheBatchTransactionKeepsOthersClaims(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := range 6 {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	const name = "rolls-back-tx-sql"
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if err := insertEffect(ctx, tx, ev); err != nil {
			return err
		}
		if ev.ID == "e2" && ev.Attempt == 1 {
			if _, err := tx.Exec(ctx, "ROLLBACK"); err != nil {
				return err
			}
			// Another consumer of the same name handles a copy of e4 now
			// that the claim of this batch is gone.
			_, err := pool.Exec(ctx, `WITH claim AS (INSERT INTO processed_events (consumer, event_id) VALUES ($1, 'e4'))
				INSERT INTO effects (event_id, n) VALUES ('e4', 4)`, name)
			assert.NoError(t, err) // not require: the handler runs in the consumer's goroutine
		}
		return nil
	}
	cfg := fastConfig(name)
	cfg.Batch.Linger = time.Second // one batch of all six
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 6 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e3": 1, "e4": 1, "e5": 1}, countEffects(t, pool),
		"each message but the one that rolled back has its effect once")
	assert.Equal(t, map[string]string{"e2": string(consumer.KindHandler)}, deadLetterKinds(b))
}

// failingAck wraps a source so that every Ack fails without acking.
type failingAck struct{ consumer.Source }

type failingAckDelivery struct{ consumer.Delivery }

func (s failingAck) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return failingAckDelivery{d}, nil
}

func (failingAckDelivery) Ack(context.Context) error { return errors.New("channel closed") }

// A failed ack is logged with what the redelivery will do: a handled
// message's is skipped as a duplicate, a dead-lettered message's runs again
// and may be dead-lettered again (no claim of it was committed).
func TestFailedAckWarningSaysWhatTheRedeliveryDoes(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "fine", 1)
	publish(b, "poison", -1)
	var logs bytes.Buffer
	var mu sync.Mutex
	cfg := fastConfig("ack-fails")
	cfg.Batch.Size = 1
	cfg.Telemetry.Logger = slog.New(slog.NewTextHandler(lockedWriter{&logs, &mu}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.Payload.N < 0 {
			return consumer.Permanent(errors.New("negative"))
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, failingAck{b.Source()}, h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return len(b.DeadLetters()) == 1 && c.Stats().Handled == 1 },
		10*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())
	mu.Lock()
	defer mu.Unlock()
	var fine, poison string
	for _, line := range strings.Split(logs.String(), "\n") {
		switch {
		case !strings.Contains(line, "ack"):
		case strings.Contains(line, "event_id=fine"):
			fine = line
		case strings.Contains(line, "event_id=poison"):
			poison = line
		}
	}
	assert.Contains(t, fine, "redelivered and skipped")
	assert.NotContains(t, poison, "skipped", "a dead-lettered message's redelivery is not a duplicate")
	assert.Contains(t, poison, "dead-lettered again")
}

// A consumer started while its database is down (restarting, failing
// over) waits for it, retrying the start as it retries any infrastructure
// failure, and then handles every message once: Run does not return the
// outage as if it were a configuration error.
func TestStartWhileTheDatabaseIsDownWaitsForIt(t *testing.T) {
	ctx := context.Background()
	srv, err := pgtemp.Start(ctx, pgtemp.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })
	pool, err := pgxpool.New(ctx, srv.URL())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 2})
	for i := range 20 {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	require.NoError(t, srv.Stop(ctx))

	c, err := consumer.New(pool, b.Source(), insertEffect, fastConfig("start-db-down"))
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	for deadline := time.Now().Add(20 * time.Second); c.Stats().InfraErrors < 3; {
		select {
		case err := <-done:
			t.Fatalf("Run returned while the database was down: %v", err)
		case <-time.After(5 * time.Millisecond):
		}
		require.True(t, time.Now().Before(deadline), "the start is retried as an infrastructure failure")
	}

	require.NoError(t, srv.Restart(ctx))
	require.Eventually(t, func() bool { return b.Acked() == 20 }, 60*time.Second, 10*time.Millisecond)
	cancel()
	require.NoError(t, <-done)
	requireEffectsOnce(t, pool, 20)
	assert.Empty(t, b.DeadLetters())
}

// timingOutSource is a memsource.Source whose deliveries can be taken
// back as a broker takes back a delivery unacked past its timeout
// (RabbitMQ's consumer_timeout): their context ends with
// consumer.ErrDeliveryTimedOut, and the source closes.
type timingOutSource struct {
	*memsource.Source
	ctx    context.Context
	cancel context.CancelCauseFunc
}

func newTimingOutSource(b *memsource.Broker) *timingOutSource {
	ctx, cancel := context.WithCancelCause(context.Background())
	return &timingOutSource{Source: b.Source(), ctx: ctx, cancel: cancel}
}

func (s *timingOutSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return timingOutDelivery{d, s.ctx}, nil
}

// lose loses every delivery of s, with cause (nil: a lost connection).
func (s *timingOutSource) lose(cause error) error {
	s.cancel(cause)
	return s.Close()
}

func (s *timingOutSource) Close() error {
	s.cancel(nil)
	return s.Source.Close()
}

type timingOutDelivery struct {
	consumer.Delivery
	ctx context.Context
}

func (d timingOutDelivery) Context() context.Context { return d.ctx }

// runCycles runs a consumer on b with h, one Source after another: every
// time h reports on cut that the delivery it ran was lost (its source lost
// them all), the consumer is stopped and a new one opened, until b has
// acked want messages. It returns the number of consumers run; it fails
// the test past maxCycles.
func runCycles(t *testing.T, pool *pgxpool.Pool, b *memsource.Broker, current *atomic.Pointer[timingOutSource],
	cut <-chan struct{}, h consumer.Handler[order], cfg consumer.Config, want, maxCycles int) int {
	t.Helper()
	for cycle := 1; ; cycle++ {
		require.LessOrEqual(t, cycle, maxCycles, "the message is handled again and again")
		src := newTimingOutSource(b)
		current.Store(src)
		c, err := consumer.New(pool, src, h, cfg)
		require.NoError(t, err)
		stop := start(t, c)
		deadline := time.After(20 * time.Second)
		for lost := false; !lost; {
			select {
			case <-cut:
				lost = true
			case <-deadline:
				t.Fatalf("cycle %d: neither settled nor cut", cycle)
			case <-time.After(5 * time.Millisecond):
				if b.Acked() == want {
					_ = stop()
					return cycle
				}
			}
		}
		_ = stop()
	}
}

// A handler that outlasts the broker's timeout for an unacked delivery
// every time (RabbitMQ's consumer_timeout, which closes the channel)
// counts each run cut so while it ran alone, as a crash: the message is
// dead-lettered as a crash loop after CrashGuard.MaxCrashes such runs,
// instead of being redelivered and run again for ever.
func TestHandlerOutlastingTheBrokersTimeoutEveryTimeIsDeadLettered(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "stuck", 1)
	publish(b, "fine", 2)
	var current atomic.Pointer[timingOutSource]
	cut := make(chan struct{}, 16)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "stuck" {
			assert.NoError(t, current.Load().lose(consumer.ErrDeliveryTimedOut)) // not require: the consumer's goroutine
			<-ctx.Done()
			cut <- struct{}{}
			return ctx.Err()
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("outlasts-timeout")
	cfg.Retry.MaxAttempts = 10
	cycles := runCycles(t, pool, b, &current, cut, h, cfg, 2, 8)
	// The first run is no suspect's, and not counted; each of the next
	// three, alone, counts; the fifth delivery is dead-lettered.
	assert.Equal(t, 5, cycles)
	require.Len(t, b.DeadLetters(), 1)
	dl := deadLetterOf(t, b, "stuck")
	assert.Equal(t, string(consumer.KindCrashLoop), dl.Headers[consumer.HeaderErrorKind])
	assert.Contains(t, dl.Headers[consumer.HeaderErrorMessage], "timeout")
	assert.Equal(t, map[string]int{"fine": 1}, countEffects(t, pool))
}

// A delivery lost with its connection is never charged to its message,
// also when the message runs alone as a suspect: one cut short by four
// lost connections in a row, with CrashGuard.MaxCrashes 2, still runs and
// commits.
func TestLostConnectionsAreNeverCharged(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := range 3 {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	var current atomic.Pointer[timingOutSource]
	cut := make(chan struct{}, 16)
	var blips atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "e1" && blips.Add(1) <= 4 {
			assert.NoError(t, current.Load().lose(nil)) // not require: the consumer's goroutine
			<-ctx.Done()
			cut <- struct{}{}
			return ctx.Err()
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("blips")
	cfg.CrashGuard.MaxCrashes = 2
	assert.Equal(t, 5, runCycles(t, pool, b, &current, cut, h, cfg, 3, 5))
	assert.Empty(t, b.DeadLetters())
	assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e2": 1}, countEffects(t, pool))
}
