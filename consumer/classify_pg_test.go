package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
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
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// A lock_timeout (55P03) met because another transaction holds the rows
// the handler writes is contention, not poison: the message waits for the
// lock's holder, retried as an infrastructure failure, and is handled
// once the lock is released, instead of being dead-lettered after
// Retry.MaxAttempts while the other transaction still runs.
func TestLockTimeoutUnderContentionIsNoPoison(t *testing.T) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	ctx := context.Background()
	_, err := admin.Exec(ctx, `CREATE TABLE accounts (id int PRIMARY KEY, n int NOT NULL); INSERT INTO accounts VALUES (1, 0)`)
	require.NoError(t, err)
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["lock_timeout"] = "20ms"
	})
	holder, err := admin.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT * FROM accounts WHERE id = 1 FOR UPDATE`)
	require.NoError(t, err)

	b := memsource.New(memsource.Options{Streams: 1})
	for i := range 3 {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	var lockTimeouts atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if _, err := tx.Exec(ctx, `UPDATE accounts SET n = n + 1 WHERE id = 1`); err != nil {
			if sqlStateOf(err) == "55P03" {
				lockTimeouts.Add(1)
			}
			return err
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("lock-timeout"))
	require.NoError(t, err)
	start(t, c)
	// More lock timeouts than Retry.MaxAttempts allows runs.
	require.Eventually(t, func() bool { return lockTimeouts.Load() > 6 || len(b.DeadLetters()) > 0 }, 10*time.Second, time.Millisecond)
	require.NoError(t, holder.Commit(ctx))
	require.Eventually(t, func() bool { return b.Acked() == 3 }, 10*time.Second, time.Millisecond)
	assert.Empty(t, deadLetterKinds(b), "no message is dead-lettered for a lock another transaction held")
	assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e2": 1}, countEffects(t, admin))
	var n int
	require.NoError(t, admin.QueryRow(ctx, `SELECT n FROM accounts WHERE id = 1`).Scan(&n))
	assert.Equal(t, 3, n)
}

func sqlStateOf(err error) string {
	var pgErr interface{ SQLState() string }
	if errors.As(err, &pgErr) {
		return pgErr.SQLState()
	}
	return ""
}

// After a failover, connections the pool keeps to a server that is now
// read-only fail every write with 25006: an infrastructure failure, which
// the consumer retries, on new connections: the pool is reset, and the
// messages are handled once, without waiting for the pool to retire the
// read-only connections (MaxConnLifetime, an hour by default). They used
// to be used for every retry, from the store's migration on.
func TestReadOnlyConnectionsAfterAFailoverAreNotReusedForever(t *testing.T) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.MaxConns = 2 })
	// Both of the pool's connections reach a server that has become read-only.
	pgtest.TurnReadOnly(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := range 3 {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	c, err := consumer.New(pool, b.Source(), insertEffect, fastConfig("read-only"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 3 }, 10*time.Second, time.Millisecond)
	assert.Empty(t, deadLetterKinds(b))
	assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e2": 1}, countEffects(t, admin))
}

// idleInTransactionSetup returns an admin pool, a pool whose sessions the
// server ends after 250 ms idle in a transaction, and a one-stream source
// holding e0..e5. The handlers that idle wait until their session is gone,
// whatever the setting; 250 ms keeps the consumer's own steps, held up
// between two statements on a busy machine, from meeting it too.
func idleInTransactionSetup(t *testing.T) (admin, pool *pgxpool.Pool, b *memsource.Broker) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	pool = pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = "250ms"
	})
	b = memsource.New(memsource.Options{Streams: 1})
	for i := range 6 {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	return admin, pool, b
}

// idleUntilTheSessionEnds works outside the database, in tx, until the
// server ended tx's session.
func idleUntilTheSessionEnds(ctx context.Context, t *testing.T, admin *pgxpool.Pool, tx pgx.Tx) {
	var pid int
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&n))
		return n == 0
	}, 10*time.Second, time.Millisecond)
}

// A session that idle_in_transaction_session_timeout ended while a handler
// of a batch worked outside the database loses nothing: the server's
// FATAL 25P03 (or the closed connection) reaches the next statement, here
// the next handler's: the batch is halved until the messages run apart,
// and every message has its effect once.
func TestIdleInTransactionTimeoutMidBatchLosesNothing(t *testing.T) {
	admin, pool, b := idleInTransactionSetup(t)
	var killed, ended atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if err := insertEffect(ctx, tx, ev); err != nil {
			ended.Add(1) // 25P03, or the closed connection if the write came first
			return err
		}
		if ev.ID == "e2" && killed.Load() == 0 {
			idleUntilTheSessionEnds(ctx, t, admin, tx)
			killed.Add(1)
		}
		return nil
	}
	cfg := fastConfig("idle-in-tx")
	cfg.Batch.Linger = time.Second // one batch of all six
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 6 }, 10*time.Second, time.Millisecond)
	assert.Equal(t, int32(1), ended.Load(), "the next statement met the end of the session")
	assert.Empty(t, deadLetterKinds(b))
	assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e2": 1, "e3": 1, "e4": 1, "e5": 1}, countEffects(t, admin))
}

// A handler that works outside the database past
// idle_in_transaction_session_timeout every time is charged, alone, and
// dead-lettered by the retry policy; the message whose statement met the
// end of the session next in its batch is not its culprit (the idle time
// ran across both handlers): with Retry.MaxAttempts 1 it was dead-lettered
// for its neighbour's wait.
func TestIdleInTransactionTimeoutIsNotChargedToTheNextHandler(t *testing.T) {
	idlePastTheTimeoutIsCharged(t, fastConfig("idle-in-tx-charge"), 0)
}

// idlePastTheTimeoutIsCharged runs, with cfg (Retry.MaxAttempts 1, one
// batch of all six), a handler that idles in e2's transaction until the
// server ended its session, then works outside the database for
// workAfter, and checks that e2 alone was dead-lettered.
func idlePastTheTimeoutIsCharged(t *testing.T, cfg consumer.Config, workAfter time.Duration) {
	t.Helper()
	admin, pool, b := idleInTransactionSetup(t)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if err := insertEffect(ctx, tx, ev); err != nil {
			return err
		}
		if ev.ID == "e2" {
			idleUntilTheSessionEnds(ctx, t, admin, tx)
			select {
			case <-time.After(workAfter):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	}
	cfg.Retry.MaxAttempts = 1
	cfg.Batch.Linger = time.Second // one batch of all six
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 6 }, 20*time.Second, time.Millisecond)
	assert.Equal(t, map[string]string{"e2": string(consumer.KindHandler)}, deadLetterKinds(b))
	assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e3": 1, "e4": 1, "e5": 1}, countEffects(t, admin))
}

// PostgreSQL 17's transaction_timeout ends a transaction that ran too long
// with 25P04, at whichever statement is running: with a batch's handlers
// run one after another, the handler whose statement met it is not its
// cause (the time ran across the batch), and a message dead-lettered for
// it was lost to a batch too long for the setting. The batch is halved
// until its runs fit. (PostgreSQL 15, this machine's, has no
// transaction_timeout: a trigger raises its SQLSTATE from the fourth
// insert of a transaction, a batch's time running out at its fourth
// handler.)
func TestTransactionTimeoutIsNotChargedToTheHandlerThatMetIt(t *testing.T) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	_, err := admin.Exec(context.Background(), `
CREATE FUNCTION transaction_time_runs_out() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
	n int := coalesce(nullif(current_setting('test.inserts', true), ''), '0')::int + 1;
BEGIN
	PERFORM set_config('test.inserts', n::text, true);
	IF n > 3 THEN
		RAISE EXCEPTION 'terminating connection due to transaction timeout' USING ERRCODE = '25P04';
	END IF;
	RETURN NEW;
END $$;
CREATE TRIGGER transaction_time_runs_out BEFORE INSERT ON effects
	FOR EACH ROW EXECUTE FUNCTION transaction_time_runs_out()`)
	require.NoError(t, err)
	pool := pgtest.NewPool(t, schema)
	b := memsource.New(memsource.Options{Streams: 1})
	want := map[string]int{}
	for i := range 8 {
		publish(b, fmt.Sprintf("e%d", i), i)
		want[fmt.Sprintf("e%d", i)] = 1
	}
	cfg := fastConfig("transaction-timeout")
	cfg.Retry.MaxAttempts = 1
	cfg.Batch.Linger = time.Second // one batch of all eight
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 8 }, 10*time.Second, time.Millisecond)
	assert.Empty(t, deadLetterKinds(b), "no handler charged for the batch's time")
	assert.Equal(t, want, countEffects(t, admin))
}

// Two consumers (two services) whose handlers write the same business rows
// in opposite orders meet a deadlock (40P01): the transaction PostgreSQL
// aborts is retried as infrastructure, never charged as a handler failure,
// and each event of each consumer has its effect once.
func TestDeadlockBetweenTwoConsumersIsRetried(t *testing.T) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	ctx := context.Background()
	_, err := admin.Exec(ctx, `CREATE TABLE accounts (id int PRIMARY KEY, n int NOT NULL); INSERT INTO accounts VALUES (1, 0), (2, 0)`)
	require.NoError(t, err)
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["deadlock_timeout"] = "20ms"
	})
	var deadlocks atomic.Int32
	locked := map[string]chan struct{}{"billing": make(chan struct{}), "audit": make(chan struct{})}
	handler := func(name, other string, first, second int) consumer.Handler[order] {
		var once atomic.Bool
		return func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
			err := func() error {
				if _, err := tx.Exec(ctx, `UPDATE accounts SET n = n + 1 WHERE id = $1`, first); err != nil {
					return err
				}
				if once.CompareAndSwap(false, true) {
					// Both hold their first row before either writes its second.
					close(locked[name])
					select {
					case <-locked[other]:
					case <-ctx.Done():
						return ctx.Err()
					}
				}
				_, err := tx.Exec(ctx, `UPDATE accounts SET n = n + 1 WHERE id = $1`, second)
				return err
			}()
			if err != nil {
				if sqlStateOf(err) == "40P01" {
					deadlocks.Add(1)
				}
				return err
			}
			_, err = tx.Exec(ctx, `INSERT INTO effects (event_id, n) VALUES ($1, $2)`, name+"/"+ev.ID, ev.Payload.N)
			return err
		}
	}
	var brokers []*memsource.Broker
	for _, c := range []struct {
		name string
		h    consumer.Handler[order]
	}{{"billing", handler("billing", "audit", 1, 2)}, {"audit", handler("audit", "billing", 2, 1)}} {
		b := memsource.New(memsource.Options{Streams: 1})
		publish(b, "e1", 1)
		brokers = append(brokers, b)
		cfg := fastConfig(c.name)
		cfg.Retry.MaxAttempts = 1 // a deadlock charged as a handler failure would dead-letter at once
		cons, err := consumer.New(pool, b.Source(), c.h, cfg)
		require.NoError(t, err)
		start(t, cons)
	}
	for _, b := range brokers {
		require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, time.Millisecond)
		assert.Empty(t, deadLetterKinds(b))
	}
	// At least one: on a loaded machine the retry can meet the other's
	// locks again, and both were seen aborted.
	assert.GreaterOrEqual(t, deadlocks.Load(), int32(1), "the transactions met the deadlock")
	assert.Equal(t, map[string]int{"billing/e1": 1, "audit/e1": 1}, countEffects(t, admin))
	var n1, n2 int
	require.NoError(t, admin.QueryRow(ctx, `SELECT (SELECT n FROM accounts WHERE id = 1), (SELECT n FROM accounts WHERE id = 2)`).Scan(&n1, &n2))
	assert.Equal(t, [2]int{2, 2}, [2]int{n1, n2}, "each consumer's writes once")
}

// A server out of connections for the consumer's role (53300
// too_many_connections, here its CONNECTION LIMIT) refuses the pool's new
// connections: an infrastructure failure, retried, while the connection
// the pool has does the work; no message is charged or dead-lettered, and
// each has its effect once.
func TestTooManyConnectionsIsNoMessagesFailure(t *testing.T) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	ctx := context.Background()
	role := "limited_" + strings.TrimPrefix(schema, "t_")
	role = role[:min(len(role), 60)]
	_, err := admin.Exec(ctx, `CREATE ROLE `+role+` LOGIN CONNECTION LIMIT 1`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role) })
	_, err = admin.Exec(ctx, `GRANT ALL ON SCHEMA `+schema+` TO `+role+`; GRANT ALL ON ALL TABLES IN SCHEMA `+schema+` TO `+role+
		`; GRANT ALL ON ALL SEQUENCES IN SCHEMA `+schema+` TO `+role)
	require.NoError(t, err)
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		c.ConnConfig.User = role
		c.ConnConfig.Password = ""
		c.MaxConns = 4
	})
	b := memsource.New(memsource.Options{}) // unordered: transactions at once
	for i := range 20 {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	var refused atomic.Int32
	cfg := fastConfig("too-many-connections")
	cfg.Concurrency = 4
	cfg.Batch.Size = 1
	cfg.Hooks.OnRetry = func(_ context.Context, r consumer.Retry) {
		if sqlStateOf(r.Err) == "53300" {
			refused.Add(1)
		}
	}
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 20 }, 20*time.Second, time.Millisecond)
	assert.Empty(t, deadLetterKinds(b))
	requireEffectsOnce(t, admin, 20)
	assert.Positive(t, refused.Load(), "the server refused connections (53300)")
}

// levelLog is a slog.Handler keeping every record's level and message.
type levelLog struct {
	mu      sync.Mutex
	records []string
}

func (l *levelLog) Enabled(context.Context, slog.Level) bool { return true }
func (l *levelLog) Handle(_ context.Context, r slog.Record) error {
	s := r.Level.String() + " " + r.Message
	r.Attrs(func(a slog.Attr) bool {
		s += " " + a.String()
		return true
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	l.records = append(l.records, s)
	return nil
}
func (l *levelLog) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *levelLog) WithGroup(string) slog.Handler      { return l }

func (l *levelLog) lines() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.records)
}

// A role the database refuses the consumer's own statements (here INSERT
// on processed_events, so every claim fails with 42501) is retried as an
// infrastructure failure, no message charged or dead-lettered, but logged
// at level Error naming the refusal: the consumer stands still until a
// grant is fixed, which a warning like a blip's hid.
func TestRefusedPrivilegeOnTheConsumersOwnWorkIsAnError(t *testing.T) {
	pool := poolOfARoleWithout(t, "INSERT")
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e0", 0)
	log := &levelLog{}
	cfg := fastConfig("refused-privilege")
	cfg.Telemetry.Logger = slog.New(log)
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	refusal := func() string {
		for _, l := range log.lines() {
			if strings.HasPrefix(l, "ERROR ") && strings.Contains(l, "42501") {
				return l
			}
		}
		return ""
	}
	require.Eventually(t, func() bool { return c.Stats().InfraErrors >= 3 }, 20*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())
	require.NotEmpty(t, refusal(), "no error-level record of the refusal in %q", log.lines())
	assert.Contains(t, refusal(), "privilege")
	for _, l := range log.lines() {
		assert.False(t, strings.HasPrefix(l, "WARN ") && strings.Contains(l, "42501"), "the refusal logged as a blip: %s", l)
	}
	assert.Zero(t, b.Acked())
	assert.Empty(t, b.DeadLetters())
}

// Retention refused by the database (a role without DELETE on
// processed_events) fails at every pass, for good, and the table grows
// without bound: logged at Warn, like a passing failure, it went unseen.
// It is logged at Error.
func TestRetentionRefusedByTheDatabaseIsAnError(t *testing.T) {
	pool := poolOfARoleWithout(t, "DELETE")
	b := memsource.New(memsource.Options{Streams: 1})
	log := &levelLog{}
	cfg := fastConfig("refused-retention")
	cfg.Retention.MaxAge = time.Hour
	cfg.Telemetry.Logger = slog.New(log)
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	refusal := func() string {
		for _, l := range log.lines() {
			if strings.Contains(l, "retention") && strings.Contains(l, "42501") {
				return l
			}
		}
		return ""
	}
	require.Eventually(t, func() bool { return refusal() != "" }, 20*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())
	assert.True(t, strings.HasPrefix(refusal(), "ERROR "), "the refusal logged as a blip: %s", refusal())
}

// poolOfARoleWithout returns a pool of a new role that may do everything
// in a test schema with the consumer's tables migrated, but privilege on
// processed_events.
func poolOfARoleWithout(t *testing.T, privilege string) *pgxpool.Pool {
	t.Helper()
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	ctx := context.Background()
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, admin))
	role := "no" + strings.ToLower(privilege) + "_" + strings.TrimPrefix(schema, "t_")
	role = role[:min(len(role), 60)]
	_, err = admin.Exec(ctx, `CREATE ROLE `+role+` LOGIN`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role) })
	_, err = admin.Exec(ctx, `GRANT ALL ON SCHEMA `+schema+` TO `+role+`; GRANT ALL ON ALL TABLES IN SCHEMA `+schema+` TO `+role+
		`; GRANT ALL ON ALL SEQUENCES IN SCHEMA `+schema+` TO `+role+`; REVOKE `+privilege+` ON processed_events FROM `+role)
	require.NoError(t, err)
	return pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		c.ConnConfig.User = role
		c.ConnConfig.Password = ""
	})
}

// A session the server ended past idle_in_transaction_session_timeout
// while the consumer's own start-up transaction (the store's migration)
// waited on the client (a busy machine between two statements) failed
// Run at once with 25P03, as a refusal of the configuration: the service
// stopped for a moment's stall. The start is retried, as for a lost
// connection, and the consumer runs.
func TestIdleInTransactionTimeoutDuringStartIsRetried(t *testing.T) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	tracer := &pgtest.StallOnce{Stall: 300 * time.Millisecond}
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = "50ms"
		c.ConnConfig.Tracer = tracer
	})
	b := memsource.New(memsource.Options{Streams: 1})
	for i := range 3 {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	c, err := consumer.New(pool, b.Source(), insertEffect, fastConfig("idle-at-start"))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	deadline := time.After(30 * time.Second)
	for b.Acked() < 3 {
		select {
		case err := <-done:
			t.Fatalf("Run returned before handling the messages: %v", err)
		case <-deadline:
			t.Fatalf("%d of 3 messages acked after 30 s", b.Acked())
		case <-time.After(5 * time.Millisecond):
		}
	}
	require.True(t, tracer.Stalled(), "the start-up transaction was not held up")
	assert.Equal(t, map[string]int{"e0": 1, "e1": 1, "e2": 1}, countEffects(t, admin))
	cancel()
	require.NoError(t, <-done)
}
