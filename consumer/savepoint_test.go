package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// A handler's savepoint (tx.Begin, which the Handler doc says "works as
// usual") is a pgx.Tx of its own: its statements went to the connection
// directly, past the consumer's queue. What the handler had queued with
// Event.Queue was then sent after them, though Queue promises that queued
// statements run before any statement sent through the handler's tx: an
// UPDATE in the savepoint of the row the handler had just queued found no
// row, and the committed state was silently wrong (n stayed 1, not 2).
func TestQueuedStatementsRunBeforeASavepointsStatements(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e0", 1)
	var updated int64 = -1
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		sp, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N)
		ct, err := sp.Exec(ctx, `UPDATE effects SET n = n + 1 WHERE event_id = $1`, ev.ID)
		if err != nil {
			return err
		}
		updated = ct.RowsAffected()
		return sp.Commit(ctx)
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("savepoint-order"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, int64(1), updated, "the savepoint's UPDATE saw the row queued before it")
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT n FROM effects WHERE event_id = 'e0'`).Scan(&n))
	assert.Equal(t, 2, n, "the queued INSERT, then the savepoint's UPDATE")
}

// A handler in a batch that ended the consumer's transaction and opened
// another through a savepoint (sp.Exec("COMMIT; BEGIN")) went unseen,
// where the same through tx.Exec is caught: the claims its COMMIT made
// durable for the messages after it were kept, a later failure rolled
// their effects back, and when they ran again they were skipped as
// duplicates: effects lost, the misuser never charged.
func TestHandlerEndingTheBatchTransactionThroughASavepointLosesNoNeighbour(t *testing.T) {
	// A plain COMMIT was already caught after the handler returned; it
	// stays as a guard.
	for _, end := range []string{"COMMIT; BEGIN", "COMMIT AND CHAIN", "COMMIT"} {
		t.Run(end, func(t *testing.T) {
			endTheBatchTransaction(t, end, func(ctx context.Context, tx pgx.Tx) error {
				sp, err := tx.Begin(ctx)
				if err != nil {
					return err
				}
				_, err = sp.Exec(ctx, end)
				return err
			})
		})
	}
}
