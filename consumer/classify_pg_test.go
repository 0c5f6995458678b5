package consumer_test

import (
	"context"
	"errors"
	"fmt"
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
	ctx := context.Background()
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.MaxConns = 2 })
	// Both of the pool's connections reach a server that has become read-only.
	var conns []*pgxpool.Conn
	for range 2 {
		c, err := pool.Acquire(ctx)
		require.NoError(t, err)
		_, err = c.Exec(ctx, `SET default_transaction_read_only = on`)
		require.NoError(t, err)
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
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
