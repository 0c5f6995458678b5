package consumer_test

import (
	"context"
	"fmt"
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

// strandedDatabase returns an admin pool on a fresh schema with the
// effects table, a pool that reaches it through a proxy (configure, when
// not nil, applied to its configuration), and strand, which leaves every
// connection that pool has open and unanswered while the server ends
// their sessions: a server gone without a word reaching its clients (a
// failover's old primary, a middlebox that forgot the connections).
// Connections made after it reach the server.
func strandedDatabase(t *testing.T, configure func(*pgxpool.Config)) (admin, pool *pgxpool.Pool, strand func()) {
	t.Helper()
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	pool, proxy := pgtest.NewPoolThroughProxy(t, schema, configure)
	return admin, pool, func() { require.Positive(t, proxy.Strand(), "connections stranded") }
}

// A connection whose server vanished without a word (a failover's old
// primary, a middlebox that forgot it) leaves the consumer's own round
// trip on it unanswered until the operating system gives up on the
// connection: a quarter of an hour and more with Linux's defaults, or
// never, as here, where the other end's kernel still acknowledges. The
// stream stood still all that time. DatabaseTimeout bounds each of the
// consumer's own round trips: past it the connection is closed and the
// transaction retried on another, as infrastructure.
func TestConnectionStrandedByItsServerIsLeftBehind(t *testing.T) {
	t.Run("the commit", func(t *testing.T) {
		admin, pool, strand := strandedDatabase(t, nil)
		strandedCommitIsLeftBehind(t, admin, pool, "stranded-commit", strand)
	})

	t.Run("a pooled connection's ping", func(t *testing.T) {
		admin, pool, strand := strandedDatabase(t, func(c *pgxpool.Config) {
			// pgxpool pings a connection idle for more than a second
			// before handing it out; here every time.
			c.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return true }
		})
		b := memsource.New(memsource.Options{Streams: 1})
		publish(b, "e1", 1)
		cfg := fastConfig("stranded-idle")
		cfg.DatabaseTimeout = 300 * time.Millisecond
		c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
		require.NoError(t, err)
		start(t, c)
		require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, time.Millisecond)
		strand() // the idle connections the pool keeps
		publish(b, "e2", 2)
		require.Eventually(t, func() bool { return b.Acked() == 2 }, 20*time.Second, time.Millisecond,
			"the stream goes on once the ping went unanswered for DatabaseTimeout")
		assert.Empty(t, b.DeadLetters())
		assert.Equal(t, map[string]int{"e1": 1, "e2": 1}, countEffects(t, admin))
	})
}

// The statements handlers queue (Event.Queue) are sent after the
// handlers, one round trip before the COMMIT; they are the handlers' and
// DatabaseTimeout does not cut them. On a stranded connection that round
// trip was never answered, and the stream stood still until the operating
// system gave up on the connection. A send that has waited DatabaseTimeout
// has its transaction's server process asked after; gone from the server,
// the send is cut as infrastructure and the transaction retried.
func TestQueuedStatementsOnAStrandedConnectionAreLeftBehind(t *testing.T) {
	queue := func(ev consumer.Event[order]) {
		ev.Queue(`INSERT INTO effects (event_id, n) VALUES ($1, $2)`, ev.ID, ev.Payload.N)
	}
	for name, newConsumer := range map[string]func(pool *pgxpool.Pool, src consumer.Source, strandOnce func(), cfg consumer.Config) (*consumer.Consumer[order], error){
		"Handler": func(pool *pgxpool.Pool, src consumer.Source, strandOnce func(), cfg consumer.Config) (*consumer.Consumer[order], error) {
			return consumer.New(pool, src, func(_ context.Context, _ pgx.Tx, ev consumer.Event[order]) error {
				queue(ev)
				strandOnce() // the queued statements are the next round trip
				return nil
			}, cfg)
		},
		"BatchHandler": func(pool *pgxpool.Pool, src consumer.Source, strandOnce func(), cfg consumer.Config) (*consumer.Consumer[order], error) {
			return consumer.NewBatch(pool, src, func(_ context.Context, _ pgx.Tx, evs []consumer.Event[order]) error {
				for _, ev := range evs {
					queue(ev)
				}
				strandOnce()
				return nil
			}, cfg)
		},
	} {
		t.Run(name, func(t *testing.T) {
			admin, pool, strand := strandedDatabase(t, nil)
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "e1", 1)
			var once sync.Once
			cfg := fastConfig("stranded-queue")
			cfg.DatabaseTimeout = 300 * time.Millisecond
			c, err := newConsumer(pool, b.Source(), func() { once.Do(strand) }, cfg)
			require.NoError(t, err)
			start(t, c)
			require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, time.Millisecond,
				"the stream goes on once the queued statements went unanswered on a stranded connection")
			assert.Empty(t, b.DeadLetters())
			assert.Equal(t, map[string]int{"e1": 1}, countEffects(t, admin))
			assert.Positive(t, c.Stats().InfraErrors, "an infrastructure failure, not the message's")
		})
	}
}

// The guard: a queued statement slow on its own, longer than
// DatabaseTimeout, runs on; its server process is there, in its
// transaction.
func TestSlowQueuedStatementOutlastsDatabaseTimeout(t *testing.T) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	outlastsDatabaseTimeout(t, admin, pgtest.NewPool(t, schema), "slow-queue", func(_ context.Context, _ pgx.Tx, ev consumer.Event[order]) error {
		ev.Queue(`SELECT pg_sleep(1.5)`)
		ev.Queue(`INSERT INTO effects (event_id, n) VALUES ($1, $2)`, ev.ID, ev.Payload.N)
		return nil
	})
}

// outlastsDatabaseTimeout runs a consumer named name on pool with h, whose
// work (or the consumer's step after it) takes five times its
// DatabaseTimeout (300 ms; a loaded machine's dial of a pooled connection,
// which it bounds, stays well inside), and checks that the one message
// had its effect with no infrastructure failure and no retry: slow, not
// stranded.
func outlastsDatabaseTimeout(t *testing.T, admin, pool *pgxpool.Pool, name string, h consumer.Handler[order]) {
	t.Helper()
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "slow", 1)
	cfg := fastConfig(name)
	cfg.DatabaseTimeout = 300 * time.Millisecond
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, time.Millisecond)
	assert.Equal(t, map[string]int{"slow": 1}, countEffects(t, admin))
	assert.Zero(t, c.Stats().InfraErrors, "slow is not stranded")
	assert.Zero(t, c.Stats().Retries)
}

// A handler's statement sent on a connection whose server vanished
// without a word went unanswered until HandlerTimeout cut it, and the cut
// was charged to the message: with Retry.MaxAttempts 1 a failover
// dead-lettered every message whose handler was in the database. Once the
// handler call has run for DatabaseTimeout, the watchdog asks the server
// whether its transaction's server process is still there; gone, the
// handler is cut as infrastructure.
func TestHandlerStatementOnAStrandedConnectionIsNotCharged(t *testing.T) {
	t.Run("HandlerTimeout", func(t *testing.T) { strandedHandlerStatementIsNotCharged(t, 5*time.Second) })
	// Under NoHandlerTimeout the handler's call was not watched at all:
	// its statement waited until the operating system gave up on the
	// connection (for ever in the test).
	t.Run("NoHandlerTimeout", func(t *testing.T) { strandedHandlerStatementIsNotCharged(t, consumer.NoHandlerTimeout) })
}

// strandedHandlerStatementIsNotCharged strands the connection of a
// handler's statement under handlerTimeout: the statement is cut as
// infrastructure, and the message, with Retry.MaxAttempts 1, commits on
// the retry.
func strandedHandlerStatementIsNotCharged(t *testing.T, handlerTimeout time.Duration) {
	admin, pool, strand := strandedDatabase(t, nil)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e1", 1)
	var once sync.Once
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		once.Do(strand) // the insert is the next round trip
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("stranded-handler")
	cfg.Retry.MaxAttempts = 1
	cfg.HandlerTimeout = handlerTimeout
	cfg.DatabaseTimeout = 300 * time.Millisecond
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, time.Millisecond)
	assert.Empty(t, deadLetterKinds(b), "a stranded connection is not the message's failure")
	assert.Equal(t, map[string]int{"e1": 1}, countEffects(t, admin))
	assert.Positive(t, c.Stats().InfraErrors)
}

// The guard: a handler working outside the database for longer than
// DatabaseTimeout, its session idle in its transaction, is not cut.
func TestHandlerWorkingOutsideTheDatabaseOutlastsDatabaseTimeout(t *testing.T) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	outlastsDatabaseTimeout(t, admin, pgtest.NewPool(t, schema), "slow-handler", workOutsideTheDatabase(1500*time.Millisecond))
}

// The server ends a session idle in its transaction past
// idle_in_transaction_session_timeout itself, and says so at the next
// statement: a handler that idles past it every time is charged, also
// when it has run for DatabaseTimeout with its server process gone (the
// watchdog does not take that for a stranded connection, which would be
// retried without end).
func TestHandlerIdlePastIdleInTransactionTimeoutIsChargedNotStranded(t *testing.T) {
	cfg := fastConfig("idle-in-tx-not-stranded")
	cfg.DatabaseTimeout = 100 * time.Millisecond
	idlePastTheTimeoutIsCharged(t, cfg, 500*time.Millisecond) // on past DatabaseTimeout, the session gone
}

// A step of the consumer's own that is slow on the server is no stranded
// connection: cut at DatabaseTimeout, a COMMIT running deferred work
// longer than it failed again on every retry, without end, and a claim
// waiting for another transaction was cut with the pool's connections.
// Past DatabaseTimeout the watchdog asks whether the step's server process
// is still there; it is, and the step runs on.
func TestSlowStepOfTheConsumersOutlastsDatabaseTimeout(t *testing.T) {
	t.Run("a COMMIT running a deferred trigger", func(t *testing.T) {
		admin, schema := pgtest.Schema(t)
		effects(t, admin)
		_, err := admin.Exec(context.Background(), `
CREATE FUNCTION slow_check() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	PERFORM pg_sleep(1.5);
	RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER slow_check AFTER INSERT ON effects
	DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_check()`)
		require.NoError(t, err)
		outlastsDatabaseTimeout(t, admin, pgtest.NewPool(t, schema), "slow-commit-step", insertEffect)
	})

	t.Run("a claim waiting for another transaction", func(t *testing.T) {
		admin, schema := pgtest.Schema(t)
		effects(t, admin)
		pool := pgtest.NewPool(t, schema)
		b := memsource.New(memsource.Options{Streams: 1})
		publish(b, "e1", 1)
		cfg := fastConfig("claim-waits-step")
		cfg.DatabaseTimeout = 300 * time.Millisecond
		c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
		require.NoError(t, err)
		start(t, c)
		require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, time.Millisecond)
		ctx := context.Background()
		locker, err := admin.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = locker.Rollback(ctx) }()
		_, err = locker.Exec(ctx, `LOCK TABLE processed_events IN ACCESS EXCLUSIVE MODE`)
		require.NoError(t, err)
		publish(b, "e2", 2)
		require.Eventually(t, func() bool {
			var waiting bool
			require.NoError(t, admin.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
				WHERE wait_event_type = 'Lock' AND query ILIKE '%processed_events%')`).Scan(&waiting))
			return waiting
		}, 10*time.Second, time.Millisecond, "the claim waits for the lock")
		time.Sleep(5 * cfg.DatabaseTimeout) // the lock held past DatabaseTimeout
		require.NoError(t, locker.Rollback(ctx))
		require.Eventually(t, func() bool { return b.Acked() == 2 }, 10*time.Second, time.Millisecond)
		assert.Equal(t, map[string]int{"e1": 1, "e2": 1}, countEffects(t, admin))
		assert.Zero(t, c.Stats().InfraErrors, "a claim waiting for a lock is not a stranded connection")
	})
}

// A step on a stranded connection is cut also when the server cannot be
// reached to ask after its session (every new connection fails): nothing
// can answer the step, as DatabaseTimeout alone would have judged.
func TestStepOnAStrandedConnectionIsCutWhenTheServerCannotBeAsked(t *testing.T) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	pool, proxy := pgtest.NewPoolThroughProxy(t, schema, nil)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e1", 1)
	h := insertThenOnce(func() {
		proxy.Refuse(true)
		require.Positive(t, proxy.Strand()) // the COMMIT is the next round trip
	})
	cfg := fastConfig("stranded-unreachable")
	cfg.DatabaseTimeout = 300 * time.Millisecond
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return c.Stats().InfraErrors > 0 }, 20*time.Second, time.Millisecond,
		"the COMMIT is cut though its session could not be asked after")
	proxy.Refuse(false)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, time.Millisecond)
	assert.Empty(t, b.DeadLetters())
	assert.Equal(t, map[string]int{"e1": 1}, countEffects(t, admin))
}

// insertThenOnce returns a handler that writes its event's effect, then
// calls f, the first time only: what f breaks meets the transaction's
// next round trip, its COMMIT.
func insertThenOnce(f func()) consumer.Handler[order] {
	var once sync.Once
	return func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if err := insertEffect(ctx, tx, ev); err != nil {
			return err
		}
		once.Do(f)
		return nil
	}
}

// strandedCommitIsLeftBehind runs a consumer named name on pool whose
// handler calls strand after its first write, and checks that the
// COMMIT left unanswered was cut as infrastructure and the message then
// had its effect once.
func strandedCommitIsLeftBehind(t *testing.T, admin, pool *pgxpool.Pool, name string, strand func()) {
	t.Helper()
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e1", 1)
	cfg := fastConfig(name)
	cfg.DatabaseTimeout = 300 * time.Millisecond
	c, err := consumer.New(pool, b.Source(), insertThenOnce(strand), cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, time.Millisecond,
		"the stream goes on once the commit went unanswered")
	assert.Empty(t, b.DeadLetters())
	assert.Equal(t, map[string]int{"e1": 1}, countEffects(t, admin))
	assert.Positive(t, c.Stats().InfraErrors, "an infrastructure failure, not the message's")
}

// workOutsideTheDatabase returns a handler that writes its event's
// effect, then works outside the database for d, its session idle in its
// transaction.
func workOutsideTheDatabase(d time.Duration) consumer.Handler[order] {
	return func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if err := insertEffect(ctx, tx, ev); err != nil {
			return err
		}
		select {
		case <-time.After(d):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// acquireDeadlines records the time left before the deadline of the
// context of the first pool acquire (-1: none) once armed.
type acquireDeadlines struct {
	armed atomic.Bool
	left  chan time.Duration
}

func (a *acquireDeadlines) prepare(ctx context.Context, _ *pgx.Conn) (bool, error) {
	if !a.armed.Load() {
		return true, nil
	}
	left := time.Duration(-1)
	if d, ok := ctx.Deadline(); ok {
		left = time.Until(d)
	}
	select {
	case a.left <- left:
	default:
	}
	return true, nil
}

// DatabaseTimeout defaults to 30 seconds, NoDatabaseTimeout lifts it, and
// another negative value is refused. (Its bound on taking a pool
// connection, a transaction's first step, is read from the context pgxpool
// hands its PrepareConn hook.)
func TestDatabaseTimeoutDefaultsToThirtySeconds(t *testing.T) {
	for name, tc := range map[string]struct {
		timeout time.Duration
		bounded bool
	}{"default": {0, true}, "unbounded": {consumer.NoDatabaseTimeout, false}} {
		t.Run(name, func(t *testing.T) {
			acquires := &acquireDeadlines{left: make(chan time.Duration, 1)}
			admin, schema := pgtest.Schema(t)
			effects(t, admin)
			pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.PrepareConn = acquires.prepare })
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "one", 1)
			cfg := fastConfig("database-timeout")
			cfg.DatabaseTimeout = tc.timeout
			c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
			require.NoError(t, err)
			start(t, c)
			require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, time.Millisecond)
			acquires.armed.Store(true) // the next transaction's
			publish(b, "two", 2)
			left := <-acquires.left
			if !tc.bounded {
				assert.Equal(t, time.Duration(-1), left, "no deadline on taking a connection")
				return
			}
			assert.Greater(t, left, 25*time.Second)
			assert.LessOrEqual(t, left, consumer.DefaultDatabaseTimeout)
		})
	}
	pool, _ := pgtest.Schema(t)
	cfg := fastConfig("database-timeout")
	cfg.DatabaseTimeout = -2
	_, err := consumer.New(pool, memsource.New(memsource.Options{}).Source(), insertEffect, cfg)
	require.ErrorIs(t, err, consumer.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "DatabaseTimeout")
}

// Waiting for a pool connection others hold is not a step in the
// database: DatabaseTimeout does not end it, and it is no failure.
func TestWaitingForAHeldConnectionOutlastsDatabaseTimeout(t *testing.T) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.MaxConns = 1 })
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e0", 0)
	cfg := fastConfig("held-connection")
	cfg.DatabaseTimeout = 50 * time.Millisecond
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, time.Millisecond)
	held, err := pool.Acquire(context.Background())
	require.NoError(t, err)
	ended := pool.Stat().CanceledAcquireCount()
	failures := c.Stats().InfraErrors
	publish(b, "e1", 1)
	// Released once the consumer's wait for it has run into
	// DatabaseTimeout three times, and was taken up again. Nothing else
	// can reach the database meanwhile: a failure counted then is the
	// wait's.
	require.Eventually(t, func() bool { return pool.Stat().CanceledAcquireCount() >= ended+3 }, 10*time.Second, time.Millisecond)
	assert.Equal(t, failures, c.Stats().InfraErrors, "waiting for a held connection is no failure")
	held.Release()
	require.Eventually(t, func() bool { return b.Acked() == 2 }, 10*time.Second, time.Millisecond)
	assert.Equal(t, map[string]int{"e0": 1, "e1": 1}, countEffects(t, admin))
}

// A failover or a middlebox strands every connection of the pool at once:
// once one step went unanswered, the pool's other connections are closed
// too (pgxpool.Pool.Reset), so that the next steps open new ones. pgxpool
// pings only a connection idle for more than a second (its default
// ShouldPing), so a busy consumer's stranded connections were handed out
// unpinged, and each cost a step its DatabaseTimeout in turn.
func TestUnansweredStepLeavesThePoolsOtherConnectionsBehind(t *testing.T) {
	const idle = 6
	admin, pool, strand := strandedDatabase(t, func(c *pgxpool.Config) { c.MaxConns = idle })
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e1", 1)
	cfg := fastConfig("stranded-pool")
	cfg.DatabaseTimeout = 150 * time.Millisecond
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, time.Millisecond)
	// The pool keeps idle connections, just used.
	conns := make([]*pgxpool.Conn, idle)
	for i := range conns {
		conns[i], err = pool.Acquire(context.Background())
		require.NoError(t, err)
	}
	for _, conn := range conns {
		conn.Release()
	}
	strand()
	for i := 2; i <= 4; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	require.Eventually(t, func() bool { return b.Acked() == 4 }, 30*time.Second, time.Millisecond)
	assert.Equal(t, map[string]int{"e1": 1, "e2": 1, "e3": 1, "e4": 1}, countEffects(t, admin))
	// One step unanswered, the other stranded connections closed with it
	// (a cut or two more allowed for steps a loaded machine kept past the
	// short timeout); without the reset each stranded connection met
	// cost a cut, until they had idled a second and pgxpool pinged them.
	assert.LessOrEqual(t, c.Stats().InfraErrors, uint64(3), "the pool's stranded connections were met one by one")
}

// Behind a connection pooler a connection is told a process id that is
// not its server process's, so the server cannot be asked after it: taken
// for a server process gone, every handler call, send and step past
// DatabaseTimeout would be cut, and a slow one retried without end. The
// consumer compares the id with pg_backend_pid() at start and asks
// nothing then; each of its own steps is bounded by DatabaseTimeout, so a
// stranded connection is still left behind.
func TestBehindAPoolerNothingIsAskedAfterAndStepsAreBounded(t *testing.T) {
	t.Run("a handler working outside the database runs on", func(t *testing.T) {
		admin, schema := pgtest.Schema(t)
		effects(t, admin)
		pool, _ := pgtest.NewPoolBehindPooler(t, schema, nil)
		outlastsDatabaseTimeout(t, admin, pool, "pooler-slow-handler", workOutsideTheDatabase(1500*time.Millisecond))
	})

	t.Run("a stranded COMMIT is left behind", func(t *testing.T) {
		admin, schema := pgtest.Schema(t)
		effects(t, admin)
		pool, proxy := pgtest.NewPoolBehindPooler(t, schema, nil)
		strandedCommitIsLeftBehind(t, admin, pool, "pooler-stranded-commit", func() { require.Positive(t, proxy.Strand()) })
	})
}

// A handler that ends the consumer's transaction with a COMMIT of its own
// leaves its connection out of any transaction; the consumer then asks on
// it whether that COMMIT committed, takes back the claims it made durable
// for the messages after it, and records progress. Those statements were
// bounded by nothing but the shutdown: on a connection stranded at that
// moment (a failover's old primary, a middlebox that forgot it) they went
// unanswered until the operating system gave up on the connection, the
// stream standing still. They are steps of the consumer's own, watched
// with DatabaseTimeout like the others.
func TestStatementsAfterAHandlersCommitOnAStrandedConnectionAreLeftBehind(t *testing.T) {
	admin, pool, strand := strandedDatabase(t, nil)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := range 3 {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	var committed atomic.Bool
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if err := insertEffect(ctx, tx, ev); err != nil {
			return err
		}
		if ev.ID != "e1" || !committed.CompareAndSwap(false, true) {
			return nil
		}
		_, err := tx.Exec(ctx, "COMMIT")
		strand() // what the consumer sends next goes unanswered
		return err
	}
	cfg := fastConfig("stranded-after-handler-commit")
	cfg.DatabaseTimeout = 300 * time.Millisecond
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 3 }, 20*time.Second, time.Millisecond,
		"the stream goes on once the statements after the handler's COMMIT went unanswered")
	got := countEffects(t, admin)
	assert.Equal(t, 1, got["e0"])
	assert.Equal(t, 1, got["e2"])
	assert.Equal(t, map[string]string{"e1": string(consumer.KindHandler)}, deadLetterKinds(b),
		"the handler that ended the transaction is dead-lettered, as on a connection that answers")
}
