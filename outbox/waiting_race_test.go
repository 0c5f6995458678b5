package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// A requeue of a parked row that commits while a read of the relay marks
// the rows waiting behind it leaves none of them marked: the read waits
// for the requeue's lock on the parked row and then finds it no longer
// refused. (Without the lock the read marked them from its snapshot
// after the requeue's trigger had given back what was marked then:
// nothing; they stayed marked, out of the relay's reads, behind a key
// already released.)
func TestRequeueRacingTheMarkingLeavesNoRowMarked(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	require.NoError(t, Migrate(ctx, pool))
	store, err := New(Config{})
	require.NoError(t, err)
	sql := newRelaySQL(store.table)
	var oid uint32
	require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass('outbox')::oid`).Scan(&oid))
	var parked int64
	require.NoError(t, pool.QueryRow(ctx, `INSERT INTO outbox (event_id, topic, key, body, attempts, parked_at)
VALUES ('p', 't', 'a', 'x', 3, now()) RETURNING seq`).Scan(&parked))
	_, err = pool.Exec(ctx, `INSERT INTO outbox (event_id, topic, key, body) SELECT 'w' || g, 't', 'a', 'x' FROM generate_series(1, 5) g`)
	require.NoError(t, err)

	requeue, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = requeue.Rollback(ctx) }()
	n, err := store.Requeue(ctx, requeue, parked)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)

	read := make(chan []int64, 1)
	go func() {
		var seqs []int64
		rows, err := pool.Query(ctx, sql.fetchMarking, 100, int64(0), []int64{}, store.table, oid)
		if err == nil {
			for rows.Next() {
				var seq int64
				if rows.Scan(&seq) != nil {
					break
				}
				seqs = append(seqs, seq)
			}
			rows.Close()
		}
		read <- seqs
	}()
	// The read waits for the requeue's lock on the parked row (or, were
	// it not to take it, ends at once).
	var done bool
	require.Eventually(t, func() bool {
		select {
		case <-read:
			done = true
			return true
		default:
		}
		var waiting int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
WHERE NOT l.granted AND a.query LIKE 'WITH ready AS%'`).Scan(&waiting)
		return err == nil && waiting > 0
	}, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, requeue.Commit(ctx))
	if !done {
		select {
		case <-read:
		case <-time.After(10 * time.Second):
			t.Fatal("the read did not end after the requeue committed")
		}
	}
	var marked int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE waiting`).Scan(&marked))
	assert.Zero(t, marked, "no row is left marked behind a key the requeue released")
}
