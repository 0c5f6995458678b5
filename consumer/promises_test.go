package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
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

// deadLetterKinds maps event ids to the kind they were dead-lettered with.
func deadLetterKinds(b *memsource.Broker) map[string]string {
	kinds := map[string]string{}
	for _, d := range b.DeadLetters() {
		kinds[d.Headers[consumer.HeaderEventID]] = d.Headers[consumer.HeaderErrorKind]
	}
	return kinds
}

// deadLetterOf returns the dead letter of event id; it fails the test when
// there is none.
func deadLetterOf(t *testing.T, b *memsource.Broker, id string) memsource.DeadLetter {
	t.Helper()
	for _, d := range b.DeadLetters() {
		// A message whose id could not be found carries its producer's
		// header only.
		if d.Headers[consumer.HeaderEventID] == id || d.Message.Headers["id"] == id {
			return d
		}
	}
	t.Fatalf("no dead letter for %q; have %v", id, deadLetterKinds(b))
	return memsource.DeadLetter{}
}

// A unique constraint checked at COMMIT (deferred) fails the same way on
// every retry: the event is dead-lettered with the SQLSTATE after the
// retry policy, and the events around it commit. It was once taken for an
// infrastructure failure and retried forever, wedging the stream.
func TestDeferredConstraintFailingAtCommitIsDeadLettered(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	_, err := pool.Exec(context.Background(),
		`CREATE TABLE uniq (k int UNIQUE DEFERRABLE INITIALLY DEFERRED)`)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := 0; i < 20; i++ {
		publish(b, fmt.Sprintf("e%02d", i), i)
	}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		copies := 1
		if ev.ID == "e07" {
			copies = 2 // two rows with one key: the deferred check fails at COMMIT
		}
		for range copies {
			if _, err := tx.Exec(ctx, `INSERT INTO uniq VALUES ($1)`, ev.Payload.N); err != nil {
				return err
			}
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("deferred"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 20 }, 20*time.Second, 5*time.Millisecond)
	dl := deadLetterOf(t, b, "e07")
	assert.Equal(t, string(consumer.KindHandler), dl.Headers[consumer.HeaderErrorKind])
	assert.Equal(t, "23505", dl.Headers[consumer.HeaderErrorSQLState])
	assert.Equal(t, "3", dl.Headers[consumer.HeaderAttempts], "the retry policy's attempts")
	assert.Len(t, b.DeadLetters(), 1)
	assert.Len(t, requireEffectsOnce(t, pool, 19), 19)
	assert.Zero(t, c.Stats().InfraErrors)
}

// Errors retrying cannot cure end in the dead-letter queue, not in an
// endless infrastructure wait: a data exception, an undefined table, and a
// deadline the handler put on one of its own queries (which closes the
// connection under it), also when the handler flattens that error or
// drops it.
func TestDeterministicHandlerErrorsAreDeadLettered(t *testing.T) {
	cases := map[string]struct {
		handler  func(ctx context.Context, tx pgx.Tx) error
		sqlState string
	}{
		"division by zero": {func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `SELECT 1 / 0`)
			return err
		}, "22012"},
		"undefined table": {func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO no_such_table VALUES (1)`)
			return err
		}, "42P01"},
		// Retried as infrastructure without end before: class 53 is
		// insufficient resources, but this limit is one the statement
		// exceeds on its own, every time.
		"temp_file_limit exceeded": {func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SET LOCAL work_mem = '64kB'`); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `SET LOCAL temp_file_limit = '64kB'`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `SELECT count(*) FROM (SELECT g FROM generate_series(1, 100000) g ORDER BY g DESC OFFSET 0) s`)
			return err
		}, "53400"},
		"own deadline": {func(ctx context.Context, tx pgx.Tx) error {
			qctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
			defer cancel()
			_, err := tx.Exec(qctx, `SELECT pg_sleep(5)`)
			return err
		}, ""},
		// The same deadline, its error reported without its chain (%v),
		// or not at all: the closed connection still is the handler's
		// doing, not the database's.
		"own deadline, error flattened": {func(ctx context.Context, tx pgx.Tx) error {
			qctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
			defer cancel()
			if _, err := tx.Exec(qctx, `SELECT pg_sleep(5)`); err != nil {
				return fmt.Errorf("loading the order: %v", err) //nolint:errorlint // the chain dropped on purpose
			}
			return nil
		}, ""},
		// A context the handler canceled itself, under one of its
		// statements, closes the connection as its deadline does: an
		// errgroup whose other call failed cancels the group's context,
		// and the handler returns that other call's error. That was taken
		// for a connection lost under the handler, retried as
		// infrastructure and, after two runs alone, dead-lettered as a
		// crash loop (the error it returned nowhere in the dead letter),
		// not as the retry policy says.
		"own cancel, another call's error returned": {func(ctx context.Context, tx pgx.Tx) error {
			gctx, cancel := context.WithCancel(ctx)
			defer cancel()
			sibling := time.AfterFunc(20*time.Millisecond, cancel) // the other call of the group fails
			defer sibling.Stop()
			if _, err := tx.Exec(gctx, `SELECT pg_sleep(5)`); err != nil {
				return errors.New("the payment service refused the order")
			}
			return nil
		}, ""},
		"own cancel while reading rows": {func(ctx context.Context, tx pgx.Tx) error {
			gctx, cancel := context.WithCancel(ctx)
			defer cancel()
			sibling := time.AfterFunc(20*time.Millisecond, cancel)
			defer sibling.Stop()
			rows, err := tx.Query(gctx, `SELECT pg_sleep(5)`)
			if err != nil {
				return errors.New("the payment service refused the order")
			}
			for rows.Next() {
			}
			rows.Close()
			return errors.New("the payment service refused the order")
		}, ""},
		"own deadline, error swallowed": {func(ctx context.Context, tx pgx.Tx) error {
			qctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
			defer cancel()
			rows, err := tx.Query(qctx, `SELECT pg_sleep(5)`)
			if err == nil {
				rows.Close()
			}
			return nil
		}, ""},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "good-1", 1)
			publish(b, "bad", 2)
			publish(b, "good-2", 3)
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				if ev.ID == "bad" {
					return tc.handler(ctx, tx)
				}
				return insertEffect(ctx, tx, ev)
			}
			c, err := consumer.New(pool, b.Source(), h, fastConfig("deterministic"))
			require.NoError(t, err)
			start(t, c)
			require.Eventually(t, func() bool { return b.Acked() == 3 }, 20*time.Second, 5*time.Millisecond)
			dl := deadLetterOf(t, b, "bad")
			assert.Equal(t, string(consumer.KindHandler), dl.Headers[consumer.HeaderErrorKind])
			assert.Equal(t, tc.sqlState, dl.Headers[consumer.HeaderErrorSQLState])
			requireEffectsOnce(t, pool, 2)
		})
	}
}

var errBusy = errors.New("downstream busy")

// Config.Retry.Classify decides what an error is: here a busy dependency is
// infrastructure (retried without bound, never dead-lettered) and a
// rejected payload is permanent (dead-lettered at once); a panic in the hook
// falls back to the default class.
func TestClassifyErrorOverridesTheDefault(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "busy", 1)
	publish(b, "rejected", 2)
	publish(b, "odd", 3)
	busyRuns := 0
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		switch ev.ID {
		case "busy":
			busyRuns++
			if busyRuns <= 6 { // more than Retry.MaxAttempts
				return errBusy
			}
		case "rejected":
			return errors.New("rejected payload")
		case "odd":
			return errors.New("odd")
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("classify")
	cfg.Retry.Classify = func(err error, def consumer.ErrorClass) consumer.ErrorClass {
		switch {
		case errors.Is(err, errBusy):
			return consumer.ClassInfrastructure
		case err.Error() == "rejected payload":
			return consumer.ClassPermanent
		case err.Error() == "odd":
			panic("a bug in the hook")
		}
		return def
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 3 }, 20*time.Second, 5*time.Millisecond)
	assert.Equal(t, map[string]string{"rejected": "handler", "odd": "handler"}, deadLetterKinds(b))
	assert.GreaterOrEqual(t, busyRuns, 7, "busy was retried past Retry.MaxAttempts")
	assert.Equal(t, "1", deadLetterOf(t, b, "rejected").Headers[consumer.HeaderAttempts], "permanent: no retry")
	assert.Equal(t, "3", deadLetterOf(t, b, "odd").Headers[consumer.HeaderAttempts], "the default class: the retry policy")
	assert.GreaterOrEqual(t, c.Stats().InfraErrors, uint64(6))
	requireEffectsOnce(t, pool, 1)
}

// Waiting for a pool connection is the consumer's own time, not the
// handler's: with one connection for eight streams, every message waits
// its turn and none is dead-lettered for HandlerTimeout.
func TestWaitingForAConnectionIsNotChargedToMessages(t *testing.T) {
	_, schema := pgtest.Schema(t)
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.MaxConns = 1 })
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 8})
	for i := 0; i < 32; i++ {
		publish(b, fmt.Sprintf("e%02d", i), i)
	}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.03)`); err != nil {
			return err
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("pool-wait")
	cfg.Concurrency = 8
	cfg.Batch.Size = 1
	cfg.HandlerTimeout = 150 * time.Millisecond // less than eight handlers' time
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 32 }, 30*time.Second, 5*time.Millisecond)
	assert.Empty(t, b.DeadLetters())
	requireEffectsOnce(t, pool, 32)
}

// A handler that queries the pool instead of its tx, with every connection
// held by the consumer's transactions (here the only one, its own), waits
// for a connection only its own return frees: HandlerTimeout ends the
// wait, charged to the handler, and the message is dead-lettered by the
// retry policy instead of holding its stream for ever. The other messages
// of the stream follow it.
func TestHandlerWaitingForThePoolItHoldsIsCutByHandlerTimeout(t *testing.T) {
	_, schema := pgtest.Schema(t)
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.MaxConns = 1 })
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "pool-user", 1)
	publish(b, "tx-user", 2)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "pool-user" {
			if _, err := pool.Exec(ctx, `SELECT 1`); err != nil {
				return err
			}
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("pool-held")
	cfg.Retry.MaxAttempts = 2
	cfg.HandlerTimeout = 100 * time.Millisecond
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 2 }, 20*time.Second, 5*time.Millisecond)
	dl := deadLetterOf(t, b, "pool-user")
	assert.Contains(t, dl.Headers[consumer.HeaderErrorMessage], "HandlerTimeout")
	assert.Equal(t, "2", dl.Headers[consumer.HeaderAttempts])
	assert.Equal(t, map[string]int{"tx-user": 1}, countEffects(t, pool))
}

// A commit slower than HandlerTimeout (a deferred trigger doing work at
// COMMIT) is not the handler's: the message commits once and is never
// dead-lettered beside its effect.
func TestSlowCommitIsNotChargedToTheHandler(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	_, err := pool.Exec(context.Background(), `
CREATE FUNCTION slow_check() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(0.2); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER slow_at_commit AFTER INSERT ON effects
	DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_check();`)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "slow-commit", 1)
	cfg := fastConfig("slow-commit")
	cfg.HandlerTimeout = 50 * time.Millisecond
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, 5*time.Millisecond)
	assert.Empty(t, b.DeadLetters())
	requireEffectsOnce(t, pool, 1)
	assert.Equal(t, uint64(1), c.Stats().Handled)
}

// panicky is a payload whose decoding panics for the value "boom".
type panicky struct{ N int }

func (p *panicky) UnmarshalJSON(b []byte) error {
	if string(b) == `"boom"` {
		panic("decoder bug")
	}
	var v struct{ N int }
	err := json.Unmarshal(b, &v)
	p.N = v.N
	return err
}

type panickyEnvelope struct{}

func (panickyEnvelope) Open(value []byte) (consumer.Opened, error) {
	if string(value) == `"boom"` {
		panic("envelope bug")
	}
	return consumer.Opened{Payload: value}, nil
}

// A panic in any user function on a message's way (envelope, event id,
// decoder, fingerprint) dead-letters that message with kind panic and the
// stack, as a handler's panic does, instead of crashing the process on
// every redelivery.
func TestPanicsInUserFunctionsAreDeadLettered(t *testing.T) {
	boom := func(m *consumer.Message) bool { return string(m.Value) == `"boom"` }
	cases := map[string]func(*consumer.Config){
		"envelope": func(c *consumer.Config) { c.Envelope = panickyEnvelope{} },
		"event id": func(c *consumer.Config) {
			c.Identify.EventID = func(m *consumer.Message) (string, error) {
				if boom(m) {
					panic("event id bug")
				}
				return m.Headers["id"], nil
			}
		},
		"decoder": func(c *consumer.Config) {},
		"fingerprint": func(c *consumer.Config) {
			c.Identify.Fingerprint = func(m *consumer.Message) []byte {
				if boom(m) {
					panic("fingerprint bug")
				}
				return nil
			}
		},
	}
	for name, configure := range cases {
		t.Run(name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "before", 1)
			b.Publish(consumer.Message{Value: []byte(`"boom"`), Headers: map[string]string{"id": "boom"}, Key: []byte("boom")})
			publish(b, "after", 2)
			cfg := fastConfig("panics")
			configure(&cfg)
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[panicky]) error {
				_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, n) VALUES ($1, $2)`, ev.ID, ev.Payload.N)
				return err
			}
			c, err := consumer.New(pool, b.Source(), h, cfg)
			require.NoError(t, err)
			start(t, c)
			require.Eventually(t, func() bool { return b.Acked() == 3 }, 20*time.Second, 5*time.Millisecond)
			dl := deadLetterOf(t, b, "boom")
			assert.Equal(t, string(consumer.KindPanic), dl.Headers[consumer.HeaderErrorKind])
			assert.Contains(t, dl.Headers[consumer.HeaderErrorMessage], "bug")
			assert.NotEmpty(t, dl.Headers[consumer.HeaderErrorStack])
			requireEffectsOnce(t, pool, 2)
		})
	}
}

// stallingHandler blocks the "killer" event until its context ends (the
// process "dies" with it in flight at the shutdown deadline) and handles
// every other event; stuck receives a value each time the killer starts.
func stallingHandler(stuck chan<- struct{}) consumer.Handler[order] {
	return func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "killer" {
			stuck <- struct{}{}
			<-ctx.Done()
			return ctx.Err()
		}
		return insertEffect(ctx, tx, ev)
	}
}

// runUntilStuck runs one consumer until the killer is in flight, then
// stops it at once (a crash of the process, as far as the killer knows).
func runUntilStuck(t *testing.T, c *consumer.Consumer[order], stuck <-chan struct{}) {
	t.Helper()
	stop := start(t, c)
	select {
	case <-stuck:
	case <-time.After(20 * time.Second):
		t.Fatal("the killer was not handled")
	}
	require.NoError(t, stop())
}

// crashThenDrain runs a consumer with cfg and stallingHandler crashes
// times, each until its handler is stuck on the killer (a process that
// died there), then once more until want messages of b are acked.
func crashThenDrain(t *testing.T, pool *pgxpool.Pool, b *memsource.Broker, cfg consumer.Config, crashes, want int) (stuck chan struct{}) {
	t.Helper()
	stuck = make(chan struct{}, 16)
	for range crashes {
		c, err := consumer.New(pool, b.Source(), stallingHandler(stuck), cfg)
		require.NoError(t, err)
		runUntilStuck(t, c, stuck)
	}
	c, err := consumer.New(pool, b.Source(), stallingHandler(stuck), cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == want }, 20*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())
	return stuck
}

// A process that dies during a shared batch charges no crash to any of
// its messages: the innocent ones are handled next time, and only the
// killer, which then crashes alone, is dead-lettered as a crash loop, even
// with CrashGuard.MaxCrashes 1. Each used to be charged the batch's crash and,
// with a low limit, dead-lettered as crash loops beside the killer.
func TestSharedBatchCrashChargesNoOne(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := 0; i < 4; i++ {
		publish(b, fmt.Sprintf("before-%d", i), i)
	}
	publish(b, "killer", 9)
	for i := 0; i < 4; i++ {
		publish(b, fmt.Sprintf("after-%d", i), i)
	}
	cfg := fastConfig("shared-batch")
	cfg.CrashGuard.MaxCrashes = 1
	cfg.ShutdownTimeout = 10 * time.Millisecond
	cfg.Batch.Linger = time.Second // one batch of all nine
	crashThenDrain(t, pool, b, cfg, 2, 9)
	assert.Equal(t, map[string]string{"killer": string(consumer.KindCrashLoop)}, deadLetterKinds(b))
	requireEffectsOnce(t, pool, 8)
}

// With Retry.MaxAttempts 1 (no retry), a process that dies during a shared
// batch still charges none of its messages: after the restart each runs
// alone, and only the killer, which then crashes alone, is dead-lettered as
// a crash loop. The marks of a shared batch were taken for one spent run
// each, so every message of the batch, the ones the handler never reached
// among them, was dead-lettered as a crash loop "cut short 0 times"
// without running again.
func TestSharedBatchCrashWithOneAttemptChargesNoOne(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "before", 1)
	publish(b, "killer", 2)
	publish(b, "after", 3)
	cfg := fastConfig("shared-batch-one-attempt")
	cfg.Retry.MaxAttempts = 1
	cfg.ShutdownTimeout = 10 * time.Millisecond
	cfg.Batch.Linger = time.Second // one batch of all three
	// Run 1: the shared batch crashes. Run 2: "before" is handled alone,
	// the killer crashes alone.
	crashThenDrain(t, pool, b, cfg, 2, 3)
	assert.Equal(t, map[string]string{"killer": string(consumer.KindCrashLoop)}, deadLetterKinds(b))
	got := requireEffectsOnce(t, pool, 2)
	assert.Contains(t, got, "after", "never reached by the handler before the crash")
}

// Runs cut short by crashes count towards Retry.MaxAttempts: a message
// that kills the process is handled at most MaxAttempts times even when
// CrashGuard.MaxCrashes is higher.
func TestCrashedRunsCountTowardsMaxAttempts(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{}) // unordered, like AMQP
	publish(b, "killer", 1)
	cfg := fastConfig("crash-runs")
	cfg.Retry.MaxAttempts = 2
	cfg.CrashGuard.MaxCrashes = 10
	cfg.ShutdownTimeout = 10 * time.Millisecond
	// Run 1 is a first delivery (no record); runs 2 and 3 are recorded.
	stuck := crashThenDrain(t, pool, b, cfg, 3, 1)
	dl := deadLetterOf(t, b, "killer")
	assert.Equal(t, string(consumer.KindCrashLoop), dl.Headers[consumer.HeaderErrorKind])
	assert.Equal(t, "2", dl.Headers[consumer.HeaderAttempts])
	assert.Empty(t, stuck, "the handler ran no more than MaxAttempts recorded times")
}

// A message whose handler fails and whose process dies in every wait
// before its retry (a goroutine it started kills it a moment later) still
// spends its runs: each process's run counts once the attempt has ended,
// so the message is dead-lettered after Retry.MaxAttempts recorded runs. The record
// used to be put back to its count from before the run when the attempt
// ended, so a process that died in the wait took the run with it, and the
// message ran again in every new process, never reaching the dead-letter
// queue.
func TestRunsCutByADeathInTheBackoffCount(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{}) // unordered, like AMQP
	publish(b, "killer", 1)
	var runs atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		runs.Add(1)
		return errors.New("boom")
	}
	for process := 1; process <= 5 && b.Acked() == 0; process++ {
		waiting := make(chan struct{}, 1)
		cfg := fastConfig("death-in-backoff")
		cfg.Retry.MaxAttempts = 3
		// The process dies in the wait, never at the end of it.
		cfg.Retry.InitialBackoff, cfg.Retry.MaxBackoff = time.Hour, time.Hour
		cfg.ShutdownTimeout = 10 * time.Millisecond
		cfg.Hooks.OnRetry = func(_ context.Context, r consumer.Retry) {
			if r.Reason == consumer.RetryHandler {
				waiting <- struct{}{}
			}
		}
		c, err := consumer.New(pool, b.Source(), h, cfg)
		require.NoError(t, err)
		stop := start(t, c)
		// The process dies in the wait for the retry, unless it
		// dead-lettered the message.
		require.Eventually(t, func() bool { return len(waiting) > 0 || b.Acked() == 1 }, 20*time.Second, time.Millisecond,
			"process %d: neither a retry nor a dead letter", process)
		require.NoError(t, stop())
	}
	dl := deadLetterOf(t, b, "killer")
	assert.Equal(t, string(consumer.KindHandler), dl.Headers[consumer.HeaderErrorKind])
	assert.Equal(t, "3", dl.Headers[consumer.HeaderAttempts])
	// The first process's run, of a first delivery, has no record (see
	// TestCrashedRunsCountTowardsMaxAttempts); every later one counts.
	assert.Equal(t, int32(4), runs.Load(), "the handler ran once in each process, until its recorded runs were spent")
}

// A message whose runs were all spent by failures of its handler, and whose
// process ended before its dead letter was written (the destination down),
// is dead-lettered by the next process as a handler failure, without
// another run: none of its runs was cut short, so it is no crash loop. Its
// dead letter carries the last run's error, which the crash guard's record
// keeps (with a NUL or bytes that are not UTF-8 replaced: jsonb takes
// neither).
func TestRunsSpentByFailuresBeforeTheDeadLetterAreNoCrashLoop(t *testing.T) {
	for name, tc := range map[string]struct{ err, want string }{
		"text":         {"boom", "boom"},
		"not storable": {"bo\x00om\xff", "bo\uFFFDom"},
	} {
		t.Run(name, func(t *testing.T) { runsSpentBeforeTheDeadLetter(t, tc.err, tc.want) })
	}
}

func runsSpentBeforeTheDeadLetter(t *testing.T, errText, want string) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{}) // unordered, like AMQP
	publish(b, "failing", 1)
	var runs atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		runs.Add(1)
		return errors.New(errText)
	}
	cfg := fastConfig("spent-before-dead-letter")
	cfg.Retry.MaxAttempts = 2
	cfg.ShutdownTimeout = 10 * time.Millisecond
	waiting, deadLetterDown := make(chan struct{}, 1), make(chan struct{}, 1)
	cfg.Hooks.OnRetry = func(_ context.Context, r consumer.Retry) {
		ch := waiting
		if r.Reason == consumer.RetryInfrastructure {
			ch = deadLetterDown
		}
		select {
		case ch <- struct{}{}:
		default:
		}
	}
	// Process 1 runs it once (a first delivery: no record) and dies in the
	// wait before the retry, process 2 likewise (its run recorded), and
	// process 3 runs it once more, spending its recorded runs, and dies
	// while the dead letter cannot be written.
	b.SetDeadLetterError(errors.New("dead-letter destination down"))
	for process, ch := range []chan struct{}{waiting, waiting, deadLetterDown} {
		slow := cfg
		slow.Retry.InitialBackoff, slow.Retry.MaxBackoff = time.Hour, time.Hour
		c, err := consumer.New(pool, b.Source(), h, slow)
		require.NoError(t, err)
		stop := start(t, c)
		select {
		case <-ch:
		case <-time.After(20 * time.Second):
			t.Fatalf("process %d: the message did not get where it was to die", process+1)
		}
		require.NoError(t, stop())
	}
	require.Equal(t, int32(3), runs.Load())
	b.SetDeadLetterError(nil)
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, time.Millisecond)
	require.NoError(t, stop())
	dl := deadLetterOf(t, b, "failing")
	assert.Equal(t, string(consumer.KindHandler), dl.Headers[consumer.HeaderErrorKind], dl.Headers[consumer.HeaderErrorMessage])
	assert.Equal(t, "2", dl.Headers[consumer.HeaderAttempts])
	assert.Equal(t, want, dl.Headers[consumer.HeaderErrorMessage], "the last run's error, kept by the crash guard's record")
	assert.Equal(t, int32(3), runs.Load(), "no run past the recorded Retry.MaxAttempts")
}

// sessions is a source whose deliveries can be lost while the consumer
// runs (lose), as a closed AMQP channel's are: the broker delivers them
// again on the next session, marked redelivered, to the same process.
type sessions struct {
	b   *memsource.Broker
	mu  sync.Mutex
	cur *memsource.Source
}

func newSessions(b *memsource.Broker) *sessions { return &sessions{b: b, cur: b.Source()} }

func (s *sessions) Receive(ctx context.Context) (consumer.Delivery, error) {
	for {
		s.mu.Lock()
		cur := s.cur
		s.mu.Unlock()
		d, err := cur.Receive(ctx)
		if errors.Is(err, consumer.ErrSourceClosed) && ctx.Err() == nil {
			continue // lost: the next session delivers
		}
		return d, err
	}
}

// lose loses the deliveries of the session and opens the next.
func (s *sessions) lose() {
	s.mu.Lock()
	old := s.cur
	s.cur = s.b.Source()
	s.mu.Unlock()
	_ = old.Close()
}

func (s *sessions) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur.Close()
}

// A message whose runs were spent by failures of its handler, whose dead
// letter could not be written before its delivery was lost (a broker
// restart takes the dead-letter destination and the channel together),
// is dead-lettered on its redelivery to the same process with the error
// of its last run, the SQLSTATE of it too: that process knows it.
func TestRunsSpentDeadLetterCarriesTheLastErrorItsProcessSaw(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{}) // unordered, like AMQP
	publish(b, "failing", 1)
	src := newSessions(b)
	var runs atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		runs.Add(1)
		_, err := tx.Exec(ctx, `SELECT 1 / (n - n) FROM (VALUES ($1::int)) AS v(n)`, ev.Payload.N)
		return err
	}
	cfg := fastConfig("spent-in-this-process")
	cfg.Retry.MaxAttempts = 2
	// Each session's delivery is lost in the wait before its retry.
	cfg.Retry.InitialBackoff, cfg.Retry.MaxBackoff = time.Hour, time.Hour
	waiting, deadLetterDown := make(chan struct{}, 1), make(chan struct{}, 1)
	cfg.Hooks.OnRetry = func(_ context.Context, r consumer.Retry) {
		ch := waiting
		if r.Reason == consumer.RetryInfrastructure {
			ch = deadLetterDown
		}
		select {
		case ch <- struct{}{}:
		default:
		}
	}
	b.SetDeadLetterError(errors.New("dead-letter destination down"))
	c, err := consumer.New(pool, src, h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	// Session 1 runs it once (a first delivery: no record), session 2
	// once more (its run recorded), and session 3 a last time, spending
	// its recorded runs; its dead letter cannot be written.
	for session, ch := range []chan struct{}{waiting, waiting, deadLetterDown} {
		select {
		case <-ch:
		case <-time.After(20 * time.Second):
			t.Fatalf("session %d: the message did not get where its delivery was to be lost", session+1)
		}
		src.lose()
	}
	b.SetDeadLetterError(nil)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, time.Millisecond)
	require.NoError(t, stop())
	require.Equal(t, int32(3), runs.Load(), "no run past the recorded Retry.MaxAttempts")
	dl := deadLetterOf(t, b, "failing")
	assert.Equal(t, string(consumer.KindHandler), dl.Headers[consumer.HeaderErrorKind])
	assert.Equal(t, "2", dl.Headers[consumer.HeaderAttempts])
	assert.Contains(t, dl.Headers[consumer.HeaderErrorMessage], "division by zero")
	assert.Equal(t, "22012", dl.Headers[consumer.HeaderErrorSQLState])
}

// An attempt that ends in an infrastructure failure is no run of the
// handler's: a message whose every process dies in the wait after such a
// failure is never dead-lettered for it, and is handled once the failure
// is gone.
func TestInfrastructureFailuresCutByADeathInTheBackoffAreNoRuns(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{}) // unordered, like AMQP
	publish(b, "waiting", 1)
	var down atomic.Bool
	down.Store(true)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if down.Load() {
			return errors.New("the database behind the handler is down")
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("infra-death-in-backoff")
	cfg.Retry.MaxAttempts = 2
	cfg.Retry.Classify = func(err error, def consumer.ErrorClass) consumer.ErrorClass {
		if strings.Contains(err.Error(), "is down") {
			return consumer.ClassInfrastructure
		}
		return def
	}
	cfg.ShutdownTimeout = 10 * time.Millisecond
	for process := 1; process <= 4; process++ {
		waiting := make(chan struct{}, 1)
		slow := cfg
		slow.InfraBackoff.Initial, slow.InfraBackoff.Max = time.Hour, time.Hour // it dies in the wait
		slow.Hooks.OnRetry = func(_ context.Context, r consumer.Retry) {
			select {
			case waiting <- struct{}{}:
			default:
			}
		}
		c, err := consumer.New(pool, b.Source(), h, slow)
		require.NoError(t, err)
		stop := start(t, c)
		require.Eventually(t, func() bool { return len(waiting) > 0 || b.Acked() == 1 }, 20*time.Second, time.Millisecond,
			"process %d", process)
		require.NoError(t, stop())
		require.Empty(t, b.DeadLetters(), "process %d: an infrastructure failure is never dead-lettered", process)
	}
	down.Store(false)
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, time.Millisecond)
	require.NoError(t, stop())
	assert.Empty(t, b.DeadLetters())
	assert.Equal(t, map[string]int{"waiting": 1}, countEffects(t, pool))
}

// A redelivered message waiting between attempts (RetryAfter) does not
// hold up the other redelivered messages: the crash guard isolates one
// attempt at a time, not a message's whole handling. The slow message's
// second attempt waits for all the others, so the test would hang if they
// waited for it.
func TestSuspectWaitingToRetryDoesNotHoldUpOthers(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{}) // unordered, like AMQP
	publish(b, "slow", 0)
	for i := 1; i <= 8; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	// Run 1: deliver everything, settle nothing: each is redelivered.
	stall := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		<-ctx.Done()
		return ctx.Err()
	}
	cfg := fastConfig("suspect-retry")
	cfg.ShutdownTimeout = 10 * time.Millisecond
	first, err := consumer.New(pool, b.Source(), stall, cfg)
	require.NoError(t, err)
	stop := start(t, first)
	require.Eventually(t, func() bool { return first.Stats().Received == 9 }, 20*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())

	var slowRuns atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "slow" {
			if slowRuns.Add(1) == 1 {
				return consumer.RetryAfter(time.Hour, errors.New("not yet"))
			}
		}
		return insertEffect(ctx, tx, ev)
	}
	second, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop = start(t, second)
	// Every redelivered message is a suspect and runs isolated, so the
	// slow one's first attempt may come after some of the others (the
	// order in which they take the isolation is the scheduler's): wait for
	// both.
	require.Eventually(t, func() bool { return b.Acked() == 8 && slowRuns.Load() >= 1 }, 20*time.Second, 5*time.Millisecond,
		"the other redelivered messages do not wait for the slow one's retry, an hour away")
	require.NoError(t, stop())
	assert.Equal(t, int32(1), slowRuns.Load())
	assert.Empty(t, b.DeadLetters())
	assert.False(t, b.IsAcked(0), "the slow message is abandoned at shutdown, for redelivery")
}

// A record the crash guard left for an event that turns out to be a
// duplicate (another copy committed meanwhile) is deleted with it.
func TestDuplicateRemovesItsCrashGuardRecord(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e1", 1)
	c, err := consumer.New(pool, b.Source(), insertEffect, fastConfig("dup-record"))
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())
	// A copy of e1 was in flight when a process died: its record is there.
	_, err = pool.Exec(context.Background(),
		`INSERT INTO processed_events_attempts (consumer, event_id, attempts, crashes) VALUES ('dup-record', 'e1', 1, 1)`)
	require.NoError(t, err)
	publish(b, "e1", 1)
	c, err = consumer.New(pool, b.Source(), insertEffect, fastConfig("dup-record"))
	require.NoError(t, err)
	stop = start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 2 }, 20*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())
	assert.Equal(t, uint64(1), c.Stats().Duplicates)
	var left int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_events_attempts`).Scan(&left))
	assert.Zero(t, left)
	requireEffectsOnce(t, pool, 1)
}

func publishRaw(b *memsource.Broker, id string, value []byte) {
	b.Publish(consumer.Message{Value: value, Headers: map[string]string{"id": id}, Key: []byte("one stream")})
}

// The consumer begins stopping while the first message of a batch runs:
// the batch is rolled back and abandoned, and nothing after it is acked or
// dead-lettered, so a Kafka offset is never marked past an unfinished
// message. (A poison message after the abandoned ones was once
// dead-lettered and acked.)
func TestStopMidBatchNeverAcksPastAnAbandonedMessage(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1})
	v, _ := json.Marshal(order{N: 1})
	publishRaw(b, "a1", v)
	publishRaw(b, "a2", v)
	publishRaw(b, "poison", []byte("{not json"))
	publishRaw(b, "c", v)
	var c *consumer.Consumer[order]
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "a1" {
			consumer.BeginStopping(c) // the shutdown begins while a1 runs
		}
		return nil
	}
	var err error
	c, err = consumer.New(pool, b.Source(), h, consumer.Config{Name: "stop-mid-batch", Batch: consumer.BatchConfig{Size: 4, Linger: 5 * time.Second}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	require.Eventually(t, func() bool { return consumer.Stopping(c) }, 20*time.Second, time.Millisecond)
	cancel()
	require.NoError(t, <-done)
	assert.Zero(t, b.Acked(), "nothing is acked past the abandoned a1 and a2")
	assert.Empty(t, b.DeadLetters(), "the poison after them waits for its turn")
}

// A handler cut by HandlerTimeout in the middle of a statement has lost its
// transaction's connection (pgx closes it to cancel the statement). When it
// does not return the statement's error (rows iterated without checking
// rows.Err, an error logged and dropped), the COMMIT then fails on the
// closed connection: that is the handler's timeout, not the database's, and
// it is retried per Config.Retry and dead-lettered like any handler past
// its timeout, instead of being taken for an infrastructure failure and
// retried forever while the stream waits behind it.
func TestHandlerTimeoutWithASwallowedErrorIsDeadLettered(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "before", 1)
	publish(b, "slow", 2)
	publish(b, "after", 3)
	cfg := fastConfig("timeout-swallowed")
	cfg.HandlerTimeout = 50 * time.Millisecond
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "slow" {
			rows, _ := tx.Query(ctx, `SELECT pg_sleep(5)`)
			for rows.Next() {
			}
			rows.Close() // the error (the timeout) is not looked at
			return nil
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 3 }, 15*time.Second, 5*time.Millisecond,
		"stats %+v", c.Stats())
	dl := deadLetterOf(t, b, "slow")
	assert.Equal(t, string(consumer.KindHandler), dl.Headers[consumer.HeaderErrorKind])
	assert.Contains(t, dl.Headers[consumer.HeaderErrorMessage], "HandlerTimeout")
	got := requireEffectsOnce(t, pool, 2)
	assert.NotContains(t, got, "slow")
}

// A panic is a bug of the handler, retried per Config.Retry and then
// dead-lettered with kind panic, also when the handler's connection died
// before it (a statement of its own cut by its own deadline, whose error
// it dropped): it was taken for the connection dying under the handler, an
// infrastructure failure, and retried forever.
func TestHandlerPanicAfterItsConnectionDiedIsDeadLettered(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "before", 1)
	publish(b, "buggy", 2)
	publish(b, "after", 3)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "buggy" {
			short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
			defer cancel()
			_, _ = tx.Exec(short, `SELECT pg_sleep(5)`) // its error dropped; pgx closed the connection
			var p *order
			_ = p.N // the bug
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("panic-dead-conn"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 3 }, 15*time.Second, 5*time.Millisecond)
	assert.Equal(t, string(consumer.KindPanic), deadLetterOf(t, b, "buggy").Headers[consumer.HeaderErrorKind])
	got := requireEffectsOnce(t, pool, 2)
	assert.NotContains(t, got, "buggy")
}

// A crash loop's record is deleted once its dead letter is written, also
// when the first try of that deletion fails (here a statement refused
// once; a connection lost does the same): retried as the crash guard's
// other writes are. It was tried once, the record left behind (for good
// with Retention.MaxAge unset), and a copy of the message replayed from
// the dead letters after a fix, met by the crash guard, was dead-lettered
// as a crash loop again without running.
func TestCrashLoopRecordIsDeletedAfterAFailedTry(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	ctx := context.Background()
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "killer", 1)
	cfg := fastConfig("crash-loop-record-kept")
	cfg.CrashGuard.MaxCrashes = 1
	cfg.ShutdownTimeout = 10 * time.Millisecond
	// Process 1 crashes with the killer marked, process 2 with it alone.
	stuck := make(chan struct{}, 16)
	for range 2 {
		c, err := consumer.New(pool, b.Source(), stallingHandler(stuck), cfg)
		require.NoError(t, err)
		runUntilStuck(t, c, stuck)
	}
	// The first deletion from the attempts table fails.
	_, err := pool.Exec(ctx, `CREATE SEQUENCE deletes;
CREATE FUNCTION refuse_first_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF nextval('deletes') = 1 THEN
		RAISE EXCEPTION 'refused once';
	END IF;
	RETURN OLD;
END $$;
CREATE TRIGGER refuse_first_delete BEFORE DELETE ON processed_events_attempts
	FOR EACH ROW EXECUTE FUNCTION refuse_first_delete()`)
	require.NoError(t, err)
	// Process 3 dead-letters it.
	c, err := consumer.New(pool, b.Source(), stallingHandler(stuck), cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())
	require.Equal(t, map[string]string{"killer": string(consumer.KindCrashLoop)}, deadLetterKinds(b))
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_events_attempts`).Scan(&left))
	assert.Zero(t, left, "the dead-lettered message's record is left behind")

	// The killer, fixed, is replayed from the dead letters.
	publish(b, "killer", 1)
	c, err = consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	stop = start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 2 }, 20*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())
	assert.Len(t, b.DeadLetters(), 1, "the replayed copy is dead-lettered again")
	requireEffectsOnce(t, pool, 1)
}
