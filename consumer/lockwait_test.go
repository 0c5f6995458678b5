package consumer_test

import (
	"context"
	"fmt"
	"strings"
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

// A migration that holds a lock on a table the handler writes (an ALTER
// TABLE rewriting it), or waits in line for one behind a long query, blocks
// the handler's statement; past HandlerTimeout the statement is cut. That
// wait is another session's doing, not the message's: the attempt is
// infrastructure (retried, not charged), and once the lock is released the
// message has its effect once. Charged, it was dead-lettered after
// Retry.MaxAttempts cuts: a good message lost to a slow migration.
func TestHandlerCutWhileWaitingForAnotherSessionsLockIsNotCharged(t *testing.T) {
	for name, block := range map[string]func(t *testing.T, pool *pgxpool.Pool) (release func()){
		"lock held":                             holdTableLock,
		"migration in line behind a long query": migrationInLine,
	} {
		t.Run(name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			handledOnceAfterTheLock(t, pool, block(t, pool))
		})
	}
}

// holdTableLock takes an ACCESS EXCLUSIVE lock on effects in a transaction
// of its own, as an ALTER TABLE that rewrites the table holds it, until
// release.
func holdTableLock(t *testing.T, pool *pgxpool.Pool) (release func()) {
	ctx := context.Background()
	migration, err := pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = migration.Rollback(ctx) })
	_, err = migration.Exec(ctx, `LOCK TABLE effects IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	return func() { require.NoError(t, migration.Rollback(ctx)) }
}

// migrationInLine starts a long query on effects (a report), then an ALTER
// TABLE that waits for it, in line for its lock: every later statement on
// the table waits behind the ALTER. release ends the query; the ALTER then
// runs and commits.
func migrationInLine(t *testing.T, pool *pgxpool.Pool) (release func()) {
	ctx := context.Background()
	report, err := pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = report.Rollback(ctx) })
	_, err = report.Exec(ctx, `SELECT count(*) FROM effects`)
	require.NoError(t, err)
	altered := make(chan error, 1)
	go func() {
		_, err := pool.Exec(ctx, `ALTER TABLE effects ADD COLUMN note text`)
		altered <- err
	}()
	require.Eventually(t, func() bool {
		var waiting bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE query LIKE 'ALTER TABLE effects%' AND wait_event_type = 'Lock')`).Scan(&waiting))
		return waiting
	}, 10*time.Second, time.Millisecond, "the ALTER waits in line")
	return func() {
		require.NoError(t, report.Rollback(ctx))
		require.NoError(t, <-altered)
	}
}

// A handler whose own statement runs past HandlerTimeout, waiting for no
// one, is still charged: cut in the database, but by its own slowness.
func TestHandlerCutInItsOwnSlowStatementIsCharged(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	cfg := fastConfig("slow-statement")
	cfg.HandlerTimeout = 200 * time.Millisecond
	chargedForItsOwnSlowStatement(t, pool, cfg)
}

// chargedForItsOwnSlowStatement runs a consumer with cfg (its
// Retry.MaxAttempts set to 2) whose handler's statement sleeps until
// something cuts it, and checks that the cuts were charged: the message
// dead-lettered, no infrastructure failure counted.
func chargedForItsOwnSlowStatement(t *testing.T, pool *pgxpool.Pool, cfg consumer.Config) {
	t.Helper()
	chargedForItsOwnSlowStatementBy(t, pool, cfg, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		_, err := tx.Exec(ctx, `SELECT pg_sleep(10)`)
		return err
	})
}

// chargedForItsOwnSlowStatementBy is chargedForItsOwnSlowStatement with
// the handler h, whose statement sleeps.
func chargedForItsOwnSlowStatementBy(t *testing.T, pool *pgxpool.Pool, cfg consumer.Config, h consumer.Handler[order]) {
	t.Helper()
	cfg.Retry.MaxAttempts = 2
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e1", 1)
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, 5*time.Millisecond)
	assert.Equal(t, map[string]string{"e1": string(consumer.KindHandler)}, deadLetterKinds(b))
	assert.Zero(t, c.Stats().InfraErrors)
}

// The question of what a cut handler waited for goes on a connection of
// its own, opened as the pool opens its connections: with the pool's
// BeforeConnect (a password from a token that expires, as for a cloud
// database's IAM login). Here the pool reaches its database only through
// BeforeConnect.
func TestLockWaitQuestionUsesThePoolsBeforeConnect(t *testing.T) {
	_, schema := pgtest.Schema(t)
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		database := c.ConnConfig.Database
		c.ConnConfig.Database = "no_such_database"
		c.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
			cc.Database = database
			return nil
		}
	})
	effects(t, pool)
	handledOnceAfterTheLock(t, pool, holdTableLock(t, pool))
}

// handledOnceAfterTheLock runs a consumer whose handler writes to effects
// while another session blocks the table, its HandlerTimeout short: the
// handler's cuts are infrastructure, not dead-lettered (Retry.MaxAttempts
// 2, three cuts seen); once release ends the block, the message has its
// effect once and nothing is dead-lettered.
func handledOnceAfterTheLock(t *testing.T, pool *pgxpool.Pool, release func()) {
	t.Helper()
	cfg := fastConfig("lock-wait")
	// A second, not 200 ms: the watchdog samples the call in the last
	// half of it, on a connection it opens for the question, and on a
	// machine busy with other test binaries that connection took longer
	// than 100 ms to open once (the cut then charged, as documented for a
	// wait not seen).
	cfg.HandlerTimeout = time.Second
	handledOnceAfterTheLockWith(t, pool, release, cfg)
}

// handledOnceAfterTheLockWith is handledOnceAfterTheLock with cfg (its
// Retry.MaxAttempts set to 2), for a pool on which something else cuts
// the handler's wait.
func handledOnceAfterTheLockWith(t *testing.T, pool *pgxpool.Pool, release func(), cfg consumer.Config) {
	t.Helper()
	handledOnceAfterTheLockBy(t, pool, release, cfg, insertEffect)
}

// handledOnceAfterTheLockBy is handledOnceAfterTheLockWith with the
// handler h, which writes e1's effect.
func handledOnceAfterTheLockBy(t *testing.T, pool *pgxpool.Pool, release func(), cfg consumer.Config, h consumer.Handler[order]) {
	t.Helper()
	cfg.Retry.MaxAttempts = 2
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e1", 1)
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)

	require.Eventually(t, func() bool {
		st := c.Stats()
		return st.InfraErrors >= 3 || st.DeadLettered > 0
	}, 20*time.Second, 5*time.Millisecond)
	require.Zero(t, c.Stats().DeadLettered, "a message whose handler waited for another session's lock was dead-lettered: %v", deadLetterKinds(b))
	release()

	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, 5*time.Millisecond)
	assert.Equal(t, map[string]int{"e1": 1}, countEffects(t, pool))
	assert.Empty(t, deadLetterKinds(b))
}

// withStatementTimeout returns a pool on pool's schema whose sessions have
// statement_timeout d, as a role's setting gives them.
func withStatementTimeout(t *testing.T, d time.Duration) (admin, pool *pgxpool.Pool) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	pool = pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["statement_timeout"] = fmt.Sprint(d.Milliseconds())
	})
	return admin, pool
}

// A statement_timeout on the consumer's sessions (a role's setting, often
// below HandlerTimeout) that cancels a handler's statement while it waits
// for another session's lock (a migration's) is that session's doing too:
// infrastructure, as HandlerTimeout's cut of the same wait is. It was
// charged (57014), and the message dead-lettered after Retry.MaxAttempts
// cancels.
func TestStatementTimeoutWhileWaitingForAnotherSessionsLockIsNotCharged(t *testing.T) {
	admin, pool := withStatementTimeout(t, time.Second)
	handledOnceAfterTheLockWith(t, pool, holdTableLock(t, admin), fastConfig("statement-timeout-lock"))
}

// The same under NoHandlerTimeout, whose handler calls were not watched:
// the cancel was charged.
func TestStatementTimeoutWhileWaitingForAnotherSessionsLockIsNotChargedWithoutHandlerTimeout(t *testing.T) {
	admin, pool := withStatementTimeout(t, time.Second)
	cfg := fastConfig("statement-timeout-lock-unbounded")
	cfg.HandlerTimeout = consumer.NoHandlerTimeout
	handledOnceAfterTheLockWith(t, pool, holdTableLock(t, admin), cfg)
}

// A statement_timeout that cancels a handler's own slow statement, waiting
// for no one, is still charged.
func TestStatementTimeoutOnItsOwnSlowStatementIsCharged(t *testing.T) {
	_, pool := withStatementTimeout(t, time.Second)
	chargedForItsOwnSlowStatement(t, pool, fastConfig("statement-timeout-slow"))
	cfg := fastConfig("statement-timeout-slow-unbounded")
	cfg.HandlerTimeout = consumer.NoHandlerTimeout
	chargedForItsOwnSlowStatement(t, pool, cfg)
}

// The same for a statement the handler queued (Event.Queue), sent after it
// returned: statement_timeout canceling it while it waited for another
// session's lock was charged (57014), the message dead-lettered after
// Retry.MaxAttempts cancels.
func TestStatementTimeoutOnAQueuedStatementWaitingForAnotherSessionsLockIsNotCharged(t *testing.T) {
	admin, pool := withStatementTimeout(t, time.Second)
	handledOnceAfterTheLockBy(t, pool, holdTableLock(t, admin), fastConfig("statement-timeout-queued-lock"), queueEffect)
}

// The guard: a queued statement that statement_timeout cancels for its
// own slowness is charged.
func TestStatementTimeoutOnAQueuedSlowStatementIsCharged(t *testing.T) {
	_, pool := withStatementTimeout(t, time.Second)
	chargedForItsOwnSlowStatementBy(t, pool, fastConfig("statement-timeout-queued-slow"), func(_ context.Context, _ pgx.Tx, ev consumer.Event[order]) error {
		ev.Queue(`SELECT pg_sleep(10)`)
		return nil
	})
}

// Behind a connection pooler a connection's process id is the pooler's;
// one that happens to be the id of another session, waiting for a lock,
// was taken for the handler's: the handler's own slow statement, cut at
// HandlerTimeout, counted as another session's lock wait, infrastructure,
// and retried without end. Behind a pooler nothing is sampled; the cut is
// charged. (The pretend pooler tells every connection the id of a session
// waiting for a table lock.)
func TestBehindAPoolerAnotherSessionsLockWaitIsNotTheHandlers(t *testing.T) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	ctx := context.Background()
	holder, err := admin.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback(ctx) })
	_, err = holder.Exec(ctx, `LOCK TABLE effects IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	waiter, err := admin.Acquire(ctx)
	require.NoError(t, err)
	var waiterPID uint32
	require.NoError(t, waiter.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&waiterPID))
	waited := make(chan struct{})
	go func() {
		defer close(waited)
		_, _ = waiter.Exec(ctx, `SELECT count(*) FROM effects`)
	}()
	t.Cleanup(func() {
		_ = holder.Rollback(ctx)
		<-waited
		waiter.Release()
	})
	require.Eventually(t, func() bool {
		var waiting bool
		require.NoError(t, admin.QueryRow(ctx, `SELECT cardinality(pg_blocking_pids($1)) > 0`, waiterPID).Scan(&waiting))
		return waiting
	}, 10*time.Second, time.Millisecond, "the other session waits for the lock")

	pool, _ := pgtest.NewPoolToldPID(t, schema, func(uint32) uint32 { return waiterPID }, nil)
	cfg := fastConfig("pooler-own-slow-statement")
	cfg.HandlerTimeout = 200 * time.Millisecond
	// A second, not ten: the cancel request, sent with the id told, does
	// not reach the statement's server process (a real pooler forwards
	// it), which holds the message's claim until the sleep ends.
	chargedForItsOwnSlowStatementBy(t, pool, cfg, func(ctx context.Context, tx pgx.Tx, _ consumer.Event[order]) error {
		_, err := tx.Exec(ctx, `SELECT pg_sleep(1)`)
		return err
	})
}

// statement_timeout bounds each statement, not the handler's call: a
// handler whose statement began waiting for another session's lock once
// the call had run longer than statement_timeout (its earlier statements
// took that long) was sampled only in the call's first statement_timeout,
// long before the wait, and its cancel (57014) charged: the message
// dead-lettered after Retry.MaxAttempts cancels, a good message lost to a
// migration, as before the lock waits were told from a handler's own.
func TestStatementTimeoutOnALateStatementWaitingForAnotherSessionsLockIsNotCharged(t *testing.T) {
	late := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		// Its own work first, each statement within statement_timeout,
		// longer than it together. Each is half of it: a 0.7 s one left
		// a loaded server 0.3 s before statement_timeout canceled it,
		// which is charged.
		for range 3 {
			if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.5)`); err != nil {
				return err
			}
		}
		return insertEffect(ctx, tx, ev)
	}
	for name, cfg := range map[string]consumer.Config{
		"HandlerTimeout": fastConfig("statement-timeout-late-lock"),
		"NoHandlerTimeout": func() consumer.Config {
			cfg := fastConfig("statement-timeout-late-lock-unbounded")
			cfg.HandlerTimeout = consumer.NoHandlerTimeout
			return cfg
		}(),
	} {
		t.Run(name, func(t *testing.T) {
			admin, pool := withStatementTimeout(t, time.Second)
			handledOnceAfterTheLockBy(t, pool, holdTableLock(t, admin), cfg, late)
		})
	}
}

// The sessions' statement_timeout, and whether a connection's process id
// is its server process's, are read at start. A read that failed there (a
// connection killed, a failover at that moment) was never tried again:
// the consumer ran all its life without lock-wait sampling, and a handler
// cut while it waited for a migration's lock was charged, good messages
// dead-lettered. The read is tried again at the watchdog's next tick.
// (The first read's connection is terminated by the server as the read
// is sent.)
func TestSessionsReadAgainAfterAFailureAtStart(t *testing.T) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	killer := &killFirstSettingsRead{admin: admin}
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.ConnConfig.Tracer = killer })
	cfg := fastConfig("sessions-read-again")
	// Two seconds: the read, tried again at the first tick (a quarter of
	// it), is done well before the sampling of the first call (its last
	// half) on a loaded machine.
	cfg.HandlerTimeout = 2 * time.Second
	handledOnceAfterTheLockWith(t, pool, holdTableLock(t, admin), cfg)
	assert.True(t, killer.killed.Load(), "the first read of the sessions failed")
}

// killFirstSettingsRead is a tracer that has the server terminate the
// connection of the first statement that reads the sessions' settings and
// process id (pg_backend_pid()), before the statement is sent: the read
// fails.
type killFirstSettingsRead struct {
	admin  *pgxpool.Pool
	killed atomic.Bool
}

func (k *killFirstSettingsRead) TraceQueryStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "pg_backend_pid()") && k.killed.CompareAndSwap(false, true) {
		// Waits (up to 10 s) for the server process to end.
		_, _ = k.admin.Exec(context.Background(), `SELECT pg_terminate_backend($1, 10000)`, conn.PgConn().PID())
	}
	return ctx
}

func (k *killFirstSettingsRead) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
