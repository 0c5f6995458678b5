package consumer_test

import (
	"context"
	"fmt"
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
