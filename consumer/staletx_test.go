package consumer_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// A handler that keeps its tx past its return (a goroutine it started, a
// value it stored) and uses it later must get pgx's ErrTxClosed, as with
// any pgx transaction that ended, and nothing may reach the connection:
// the pool has lent it to another message's transaction by then. The
// consumer's checks of each statement looked at the connection first:
// the stale statement was refused as a COMMIT or ROLLBACK "sent by the
// handler", which it never sent, and a stale COMMIT sent its watch
// queries (txid_current, txid_status) inside the transaction of the
// message that held the connection now.
func TestTxKeptPastTheHandlerIsClosed(t *testing.T) {
	_, schema := pgtest.Schema(t)
	// One connection: the second message's transaction gets the first's.
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.MaxConns = 1 })
	observer := pgtest.NewPool(t, schema)
	effects(t, pool)
	b := memsource.New(memsource.Options{})
	kept := make(chan pgx.Tx, 1)
	holding := make(chan uint32, 1)
	release := make(chan struct{})
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "first" {
			kept <- tx
			return insertEffect(ctx, tx, ev)
		}
		holding <- tx.Conn().PgConn().PID()
		<-release
		return nil
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("stale-tx"))
	require.NoError(t, err)
	start(t, c)
	ctx := context.Background()
	publish(b, "first", 1)
	require.NoError(t, b.WaitAcked(ctx, 1))
	stale := <-kept

	_, err = stale.Exec(ctx, `INSERT INTO effects (event_id, n) VALUES ('late', 1)`)
	assert.ErrorIs(t, err, pgx.ErrTxClosed, "a statement after the handler returned, the connection idle")
	_, err = stale.Begin(ctx)
	assert.ErrorIs(t, err, pgx.ErrTxClosed, "a savepoint after the handler returned")
	assert.ErrorIs(t, stale.Rollback(ctx), pgx.ErrTxClosed, "a Rollback after the handler returned")

	publish(b, "second", 2)
	pid := <-holding
	_, err = stale.Exec(ctx, `COMMIT`)
	assert.ErrorIs(t, err, pgx.ErrTxClosed, "a COMMIT after the handler returned, the connection in another message's transaction")
	var last string
	require.NoError(t, observer.QueryRow(ctx, `SELECT query FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&last))
	assert.NotContains(t, last, "txid", "the stale tx sent a statement in another message's transaction")
	close(release)
	require.NoError(t, b.WaitAcked(ctx, 2))
	assert.Equal(t, map[string]int{"first": 1}, countEffects(t, pool))
}
