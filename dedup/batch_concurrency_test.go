package dedup_test

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
)

// Two batches that share ids, listed in opposite orders, run at the same
// time (both paused mid-statement by a third transaction holding the id
// between them). Inserting in id order makes them take their locks in one
// order: both finish, neither is aborted as a deadlock.
func TestClaimBatchesInOppositeOrdersDoNotDeadlock(t *testing.T) {
	ctx, pool, s := setup(t)
	claims := func(ids ...string) []dedup.Claim {
		out := make([]dedup.Claim, len(ids))
		for i, id := range ids {
			out[i] = dedup.Claim{Consumer: "c", EventID: id, Partition: -1, Offset: -1}
		}
		return out
	}
	holder, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer holder.Rollback(ctx) //nolint:errcheck
	_, err = s.Claim(ctx, holder, claims("m")[0])
	require.NoError(t, err)

	type outcome struct {
		res []dedup.Result
		err error
	}
	run := func(ids ...string) (<-chan outcome, uint32) {
		conn, err := pool.Acquire(ctx)
		require.NoError(t, err)
		pid := conn.Conn().PgConn().PID()
		done := make(chan outcome, 1)
		go func() {
			defer conn.Release()
			var o outcome
			o.err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				var err error
				o.res, err = s.ClaimBatch(ctx, tx, claims(ids...))
				return err
			})
			done <- o
		}()
		return done, pid
	}
	a, pidA := run("y", "m", "x")
	waitBlocked(t, ctx, pool, pidA)
	b, pidB := run("x", "m", "y")
	waitBlocked(t, ctx, pool, pidB)
	require.NoError(t, holder.Rollback(ctx)) // let them go

	oa, ob := <-a, <-b
	require.NoError(t, oa.err, "batch A")
	require.NoError(t, ob.err, "batch B")
	claimed := 0
	for _, r := range append(oa.res, ob.res...) {
		if r.Outcome == dedup.Claimed {
			claimed++
		}
	}
	assert.Equal(t, 3, claimed, "x, m and y are each claimed once")
}

// A batch that waits on another transaction's uncommitted claim of one of
// its ids, which then commits: that id is a duplicate, with the other
// transaction's row as its previous one, though the batch statement's
// snapshot predates it.
func TestClaimBatchAfterConcurrentCommit(t *testing.T) {
	ctx, pool, s := setup(t)
	first, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer first.Rollback(ctx) //nolint:errcheck
	_, err = s.Claim(ctx, first, dedup.Claim{Consumer: "c", EventID: "x", Fingerprint: []byte("fx"), Partition: -1, Offset: -1})
	require.NoError(t, err)

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	pid := conn.Conn().PgConn().PID()
	done := make(chan []dedup.Result, 1)
	go func() {
		defer conn.Release()
		var res []dedup.Result
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			var err error
			res, err = s.ClaimBatch(ctx, tx, []dedup.Claim{
				{Consumer: "c", EventID: "x", Fingerprint: []byte("other"), Partition: -1, Offset: -1},
				{Consumer: "c", EventID: "y", Partition: -1, Offset: -1},
			})
			return err
		})
		assert.NoError(t, err)
		done <- res
	}()
	waitBlocked(t, ctx, pool, pid)
	require.NoError(t, first.Commit(ctx))
	res := <-done
	require.Len(t, res, 2)
	assert.Equal(t, dedup.Conflict, res[0].Outcome, "x was committed by the other transaction with another fingerprint")
	assert.Equal(t, []byte("fx"), res[0].Previous.Fingerprint)
	assert.False(t, res[0].Previous.ProcessedAt.IsZero())
	assert.Equal(t, dedup.Claimed, res[1].Outcome)
}

// Ids a concurrent transaction committed while the batch statement waited
// on them (a stream's copy in the neighbouring batch, on a queue consumed
// by several transactions at once) are looked up together: one more
// statement for all of them, not an insert and a lookup for each (which
// cost RabbitMQ's batched rows 1.8 round trips per transaction in
// `make bench`).
func TestClaimBatchLooksUpConcurrentCommitsInOneStatement(t *testing.T) {
	ctx, pool, s := setup(t)
	const shared = 10
	first, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer first.Rollback(ctx) //nolint:errcheck
	var batch []dedup.Claim
	for i := range shared {
		c := dedup.Claim{Consumer: "c", EventID: fmt.Sprintf("x%d", i), Fingerprint: []byte("fx"), Partition: -1, Offset: -1}
		_, err = s.Claim(ctx, first, c)
		require.NoError(t, err)
		if i%2 == 1 {
			c.Fingerprint = []byte("other")
		}
		batch = append(batch, c)
	}
	batch = append(batch, dedup.Claim{Consumer: "c", EventID: "y", Partition: -1, Offset: -1})

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	pid := conn.Conn().PgConn().PID()
	type outcome struct {
		res        []dedup.Result
		statements int
	}
	done := make(chan outcome, 1)
	go func() {
		defer conn.Release()
		var out outcome
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			counted := &countingDB{DB: tx}
			var err error
			out.res, err = s.ClaimBatch(ctx, counted, batch)
			out.statements = int(counted.n.Load())
			return err
		})
		assert.NoError(t, err)
		done <- out
	}()
	waitBlocked(t, ctx, pool, pid)
	require.NoError(t, first.Commit(ctx))
	out := <-done
	require.Len(t, out.res, shared+1)
	for i := range shared {
		want := dedup.Duplicate
		if i%2 == 1 {
			want = dedup.Conflict
		}
		assert.Equal(t, want, out.res[i].Outcome, "x%d", i)
		assert.Equal(t, []byte("fx"), out.res[i].Previous.Fingerprint, "x%d", i)
		assert.False(t, out.res[i].Previous.ProcessedAt.IsZero(), "x%d", i)
	}
	assert.Equal(t, dedup.Claimed, out.res[shared].Outcome)
	assert.Equal(t, 2, out.statements, "the batch statement, then one lookup of the %d ids committed meanwhile", shared)
}

// An id committed by a concurrent transaction while the batch statement
// waited, and deleted by retention before the lookup that follows: the
// id is free again, so the batch claims it.
func TestClaimBatchClaimsAnIDRetentionDeletedMeanwhile(t *testing.T) {
	ctx, pool, s := setup(t)
	first, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer first.Rollback(ctx) //nolint:errcheck
	_, err = s.Claim(ctx, first, dedup.Claim{Consumer: "c", EventID: "x", Partition: -1, Offset: -1})
	require.NoError(t, err)

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	pid := conn.Conn().PgConn().PID()
	done := make(chan []dedup.Result, 1)
	go func() {
		defer conn.Release()
		var res []dedup.Result
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			counted := &countingDB{DB: tx, after: func(n int64) {
				if n == 1 { // the batch statement returned: retention runs
					_, err := pool.Exec(ctx, `DELETE FROM processed_events WHERE consumer = 'c' AND event_id = 'x'`)
					assert.NoError(t, err)
				}
			}}
			var err error
			res, err = s.ClaimBatch(ctx, counted, []dedup.Claim{{Consumer: "c", EventID: "x", Partition: -1, Offset: -1}})
			return err
		})
		assert.NoError(t, err)
		done <- res
	}()
	waitBlocked(t, ctx, pool, pid)
	require.NoError(t, first.Commit(ctx))
	res := <-done
	require.Len(t, res, 1)
	assert.Equal(t, dedup.Claimed, res[0].Outcome, "the deleted id is claimed again")
	assert.Equal(t, 1, processed(t, ctx, pool, "c", "x"))
}
