package consumer_test

import (
	"context"
	"fmt"
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
	"github.com/onceco/once/internal/pgtemp"
	"github.com/onceco/once/internal/pgtest"
)

// A handler whose statement ends its own server process every time (here
// pg_terminate_backend on itself; in production a statement that crashes
// the server or is killed for its memory) loses its connection, which is
// infrastructure, and was retried without end, taking the session down on
// every try. Now the messages of a transaction that lost its connection
// after its claims a second time run alone, as suspects; the one that
// loses it again and again alone is dead-lettered KindCrashLoop after
// CrashGuard.MaxCrashes such runs, and the messages that ran beside it
// commit once each.
func TestHandlerEndingItsServerProcessEveryTimeIsDeadLettered(t *testing.T) {
	killer := func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
		return err
	}
	t.Run("Handler", func(t *testing.T) {
		pool, _ := pgtest.Schema(t)
		sessionKillerIsDeadLettered(t, pool, "terminate-self", killer, false)
	})
	t.Run("BatchHandler", func(t *testing.T) {
		pool, _ := pgtest.Schema(t)
		sessionKillerIsDeadLettered(t, pool, "terminate-self-batch", killer, true)
	})
}

// The same with the server itself brought down: the handler's server
// process is killed (SIGKILL, as the kernel's OOM killer does), and
// PostgreSQL ends every other session and restarts. The transactions
// beside it lose their connections too; they commit once each after. The
// server is durable: with synchronous_commit off (the test servers'
// default) a crash loses commits the consumer has acked (docs/guarantees.md).
func TestHandlerCrashingTheServerEveryTimeIsDeadLettered(t *testing.T) {
	ctx := context.Background()
	srv, err := pgtemp.Start(ctx, pgtemp.Options{Durable: true})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })
	pool, err := pgxpool.New(ctx, srv.URL())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	crash := func(ctx context.Context, tx pgx.Tx) error {
		var pid int
		if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return err
		}
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `SELECT 1`)
		return err
	}
	sessionKillerIsDeadLettered(t, pool, "crash-server", crash, false)
}

// sessionKillerIsDeadLettered runs a consumer over 120 events and one,
// "killer", whose handler runs kill on its transaction; the other events'
// handlers insert their effect. killer is dead-lettered KindCrashLoop, its
// handler having run at most twice before it runs alone (the first loss
// of a session is taken for a restart) and CrashGuard.MaxCrashes times
// alone; every other event has its effect
// once, and no crash-guard record is left.
func sessionKillerIsDeadLettered(t *testing.T, pool *pgxpool.Pool, name string, kill func(context.Context, pgx.Tx) error, batch bool) {
	effects(t, pool)
	const total = 120
	b := memsource.New(memsource.Options{Streams: 4})
	for i := 0; i < total; i++ {
		if i == 10 {
			publish(b, "killer", -1)
		}
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	var killerRuns atomic.Int32
	handle := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "killer" {
			killerRuns.Add(1)
			return kill(ctx, tx)
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig(name)
	cfg.CrashGuard.MaxCrashes = 2
	cfg.Batch.Size = 20
	cfg.Batch.Linger = 10 * time.Millisecond
	var c interface{ Run(context.Context) error }
	var stats func() consumer.Stats
	if batch {
		bc, err := consumer.NewBatch(pool, b.Source(), func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
			for _, ev := range evs {
				if err := handle(ctx, tx, ev); err != nil {
					return err
				}
			}
			return nil
		}, cfg)
		require.NoError(t, err)
		c, stats = bc, bc.Stats
	} else {
		hc, err := consumer.New(pool, b.Source(), handle, cfg)
		require.NoError(t, err)
		c, stats = hc, hc.Stats
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); assert.NoError(t, <-done) })

	settled := assert.Eventually(t, func() bool { return b.Acked() == total+1 }, 60*time.Second, 5*time.Millisecond)
	require.True(t, settled, "acked %d of %d; the killer's handler ran %d times", b.Acked(), total+1, killerRuns.Load())
	dl := deadLetterOf(t, b, "killer")
	assert.Equal(t, string(consumer.KindCrashLoop), dl.Headers[consumer.HeaderErrorKind])
	assert.Contains(t, dl.Headers[consumer.HeaderErrorMessage], "connection")
	assert.LessOrEqual(t, killerRuns.Load(), int32(cfg.CrashGuard.MaxCrashes+2),
		"twice (a restart, most likely, the first time) before it runs alone, then alone until MaxCrashes")
	got := requireEffectsOnce(t, pool, total)
	assert.NotContains(t, got, "killer")
	assert.Len(t, b.DeadLetters(), 1)
	assert.Positive(t, stats().InfraErrors)
	var left int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_events_attempts`).Scan(&left))
	assert.Zero(t, left, "crash-guard records are cleared once their messages are settled")
}

// endsItsSessionOnce is a handler that ends its own server process (as a
// failover or an administrator's pg_terminate_backend would) the first
// time it runs id, and inserts its effect otherwise.
func endsItsSessionOnce(id string, ended *atomic.Int32) consumer.Handler[order] {
	return func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == id && ended.Add(1) == 1 {
			_, err := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
			return err
		}
		return insertEffect(ctx, tx, ev)
	}
}

// With Retry.MaxAttempts 1, a message of a shared batch that crashed runs
// alone next time, charged no run for the mark; a session it then loses
// once is a crash but no run (a failover must not spend its runs), and
// only CrashGuard.MaxCrashes such crashes dead-letter it. The lost
// attempt cleared the mark and put the record's runs back to 0, after
// which the run the mark stands for was taken for a spent one: the message
// was dead-lettered as a crash loop at its next attempt, after a single
// lost session, never run again.
func TestSessionLostOnceAfterASharedBatchCrashIsRetried(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "victim", 1)
	publish(b, "killer", 2)
	cfg := fastConfig("lost-once-after-mark")
	cfg.Retry.MaxAttempts = 1
	cfg.ShutdownTimeout = 10 * time.Millisecond
	cfg.Batch.Linger = time.Second // one batch of both
	// Process 1: the shared batch stalls on the killer and the process
	// "dies": both messages keep their marks.
	stuck := make(chan struct{}, 16)
	c, err := consumer.New(pool, b.Source(), stallingHandler(stuck), cfg)
	require.NoError(t, err)
	runUntilStuck(t, c, stuck)

	// Process 2: each runs alone; the victim's first run loses its session.
	var ended atomic.Int32
	c, err = consumer.New(pool, b.Source(), endsItsSessionOnce("victim", &ended), cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 2 }, 20*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())
	assert.Empty(t, deadLetterKinds(b), "one lost session is no crash loop")
	got := requireEffectsOnce(t, pool, 2)
	assert.Contains(t, got, "victim")
	assert.Equal(t, int32(2), ended.Load(), "the victim ran again after its lost session")
}

// The same across a restart: a message that lost its session once while
// it ran alone, its process stopped in the wait before the next attempt,
// has a record holding a crash and no run. The next process took the run
// the record implies for a spent one, with Retry.MaxAttempts 1, and
// dead-lettered the message as a crash loop without running it.
func TestSessionLostOnceBeforeARestartIsRetried(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{}) // unordered, like AMQP
	// Redelivered: a suspect, running alone from its first attempt.
	b.Publish(consumer.Message{Value: []byte(`{"n":1}`), Headers: map[string]string{"id": "victim"}, Key: []byte("victim"), Redelivered: true})
	cfg := fastConfig("lost-once-restart")
	cfg.Retry.MaxAttempts = 1
	// Process 1 stops in the wait after the lost session.
	cfg.InfraBackoff = consumer.Backoff{Initial: time.Hour, Max: time.Hour}
	var ended atomic.Int32
	c, err := consumer.New(pool, b.Source(), endsItsSessionOnce("victim", &ended), cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool {
		var crashes, runs int
		err := pool.QueryRow(context.Background(), `SELECT crashes, attempts FROM processed_events_attempts
			WHERE consumer = 'lost-once-restart' AND event_id = 'victim'`).Scan(&crashes, &runs)
		return err == nil && crashes == 1 && runs == 0
	}, 20*time.Second, 5*time.Millisecond, "the lost attempt was not recorded as a crash without a run")
	require.NoError(t, stop())

	cfg.InfraBackoff = fastConfig("").InfraBackoff
	c, err = consumer.New(pool, b.Source(), endsItsSessionOnce("victim", &ended), cfg)
	require.NoError(t, err)
	stop = start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())
	assert.Empty(t, deadLetterKinds(b), "one lost session is no crash loop")
	requireEffectsOnce(t, pool, 1)
	assert.Equal(t, int32(2), ended.Load(), "the victim ran again after its lost session")
}

// A suspect's attempt whose delivery is lost with its connection while its
// handler still runs (a RabbitMQ connection cut: the broker hands the
// message to another consumer at once) is no crash for the consumer that
// gets the message next (another process here; this one, its source
// reconnected, alike): it waits for the running attempt to end instead
// of reading its record, which counts that attempt as a crash until it
// ends. With CrashGuard.MaxCrashes 1 the message was dead-lettered as a
// crash loop although it never crashed.
func TestAttemptStillRunningElsewhereIsNoCrash(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{}) // unordered, like AMQP
	// Redelivered: a suspect, running alone from its first attempt.
	b.Publish(consumer.Message{Value: []byte(`{"n":1}`), Headers: map[string]string{"id": "victim"}, Key: []byte("victim"), Redelivered: true})
	cfg := fastConfig("running-elsewhere")
	cfg.CrashGuard.MaxCrashes = 1

	// Consumer A: its connection is cut while the handler runs on,
	// slow to see its context end (work outside the database).
	cut, release := make(chan struct{}), make(chan struct{})
	var released sync.Once
	letGo := func() { released.Do(func() { close(release) }) }
	t.Cleanup(letGo)
	srcA := newTimingOutSource(b)
	slow := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		require.NoError(t, srcA.lose(nil))
		close(cut)
		<-release
		return ctx.Err()
	}
	a, err := consumer.New(pool, srcA, slow, cfg)
	require.NoError(t, err)
	stopA := start(t, a)
	<-cut

	// Consumer B gets the message meanwhile, as the broker redelivers it.
	var ran atomic.Int32
	bc, err := consumer.New(pool, b.Source(), func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		ran.Add(1)
		return insertEffect(ctx, tx, ev)
	}, cfg)
	require.NoError(t, err)
	stopB := start(t, bc)
	// A's handler returns once B has dead-lettered the message, or waits
	// for A's attempt to end (a lock it waits for).
	require.Eventually(t, func() bool {
		var waiting bool
		err := pool.QueryRow(context.Background(), `SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' AND NOT granted)`).Scan(&waiting)
		return err == nil && waiting || len(b.DeadLetters()) > 0
	}, 20*time.Second, 5*time.Millisecond, "B neither dead-lettered the message nor waited for A's attempt")
	letGo()
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, 5*time.Millisecond)
	_ = stopA() // its source is closed: Run says so
	require.NoError(t, stopB())
	assert.Empty(t, deadLetterKinds(b), "a lost connection is never charged")
	requireEffectsOnce(t, pool, 1)
	assert.Equal(t, int32(1), ran.Load())
	var left int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_events_attempts`).Scan(&left))
	assert.Zero(t, left, "no crash-guard record is left behind")
}
