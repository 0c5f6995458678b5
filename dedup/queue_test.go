package dedup_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
)

// beginBatch returns a batch whose first query begins a transaction.
func beginBatch() *pgx.Batch {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	return b
}

// queueClaimTx claims c with a batch that begins the transaction and sends
// the claim with the BEGIN, and commits. It returns the result and the
// statements Result sent after the batch.
func queueClaimTx(t testing.TB, ctx context.Context, pool *pgxpool.Pool, s *dedup.Store, c dedup.Claim) (dedup.Result, int64) {
	t.Helper()
	b := beginBatch()
	pending := s.QueueClaim(b, c)
	require.Equal(t, 2, b.Len(), "BEGIN and the claim")
	br := pool.SendBatch(ctx, b)
	tx := br.Tx()
	require.NotNil(t, tx)
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	require.NoError(t, br.Close())
	db := &countingDB{DB: tx}
	r, err := pending.Result(ctx, db)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	return r, db.n.Load()
}

// queueClaimBatchTx is queueClaimTx for QueueClaimBatch.
func queueClaimBatchTx(t testing.TB, ctx context.Context, pool *pgxpool.Pool, s *dedup.Store, claims []dedup.Claim) ([]dedup.Result, int64) {
	t.Helper()
	b := beginBatch()
	pending, err := s.QueueClaimBatch(b, claims)
	require.NoError(t, err)
	br := pool.SendBatch(ctx, b)
	tx := br.Tx()
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	require.NoError(t, br.Close())
	db := &countingDB{DB: tx}
	results, err := pending.Results(ctx, db)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	return results, db.n.Load()
}

func TestQueueClaimWithBegin(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	c := dedup.Claim{Consumer: "c", EventID: "e", Fingerprint: []byte("A"), Source: "topic", Partition: 3, Offset: 7}

	// New: claimed by the batch alone, visible only after the commit.
	b := beginBatch()
	pending := s.QueueClaim(b, c)
	br := pool.SendBatch(ctx, b)
	tx := br.Tx()
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	require.NoError(t, br.Close())
	db := &countingDB{DB: tx}
	r, err := pending.Result(ctx, db)
	require.NoError(t, err)
	assert.Equal(t, dedup.Result{Outcome: dedup.Claimed}, r)
	assert.Equal(t, int64(0), db.n.Load(), "a new id costs no statement after the batch")
	assert.Equal(t, 0, processed(t, ctx, pool, "c", "e"), "nothing visible before commit")
	require.NoError(t, tx.Commit(ctx))
	assert.Equal(t, storedRow{[]byte("A"), "topic", ptr[int32](3), ptr[int64](7)}, stored(t, ctx, pool, "c", "e"))

	// The same id and fingerprint again: a duplicate, after one lookup.
	r, n := queueClaimTx(t, ctx, pool, s, c)
	assert.Equal(t, dedup.Duplicate, r.Outcome)
	assert.Equal(t, []byte("A"), r.Previous.Fingerprint)
	assert.False(t, r.Previous.ProcessedAt.IsZero())
	assert.Equal(t, int64(1), n, "the lookup of the previous row")

	// Another fingerprint: a conflict, which changes nothing.
	c.Fingerprint = []byte("B")
	r, _ = queueClaimTx(t, ctx, pool, s, c)
	assert.Equal(t, dedup.Conflict, r.Outcome)
	assert.Equal(t, []byte("A"), r.Previous.Fingerprint)
	assert.Equal(t, []byte("A"), stored(t, ctx, pool, "c", "e").Fingerprint)
	assert.Equal(t, 1, processed(t, ctx, pool, "c", "e"))
}

// QueueClaimBatch gives what ClaimBatch gives for the same input: here for
// two consumers with the same history, one claiming with ClaimBatch on an
// open transaction, the other with a batch that begins it.
func TestQueueClaimBatchMatchesClaimBatch(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)

	batch := func(consumer string) []dedup.Claim {
		return []dedup.Claim{
			{Consumer: consumer, EventID: "new-1", Fingerprint: []byte("n1"), Source: "q", Partition: -1, Offset: -1},
			{Consumer: consumer, EventID: "old-same", Fingerprint: []byte("A")},
			{Consumer: consumer, EventID: "old-diff", Fingerprint: []byte("B")},
			{Consumer: consumer, EventID: "rep", Fingerprint: []byte("R")},
			{Consumer: consumer, EventID: "new-2", Fingerprint: nil, Source: "q", Partition: 1, Offset: 5},
			{Consumer: consumer, EventID: "rep", Fingerprint: []byte("R")},
			{Consumer: consumer, EventID: "old-nil", Fingerprint: []byte("Z")},
			{Consumer: consumer, EventID: "rep2", Fingerprint: []byte("first")},
			{Consumer: consumer, EventID: "rep2", Fingerprint: []byte("second")},
			{Consumer: consumer, EventID: "rep2", Fingerprint: nil},
		}
	}
	for _, consumer := range []string{"direct", "queued"} {
		claimTx(t, ctx, pool, s, dedup.Claim{Consumer: consumer, EventID: "old-same", Fingerprint: []byte("A")})
		claimTx(t, ctx, pool, s, dedup.Claim{Consumer: consumer, EventID: "old-diff", Fingerprint: []byte("A")})
		claimTx(t, ctx, pool, s, dedup.Claim{Consumer: consumer, EventID: "old-nil", Fingerprint: nil})
	}

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	want, err := s.ClaimBatch(ctx, tx, batch("direct"))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))

	got, n := queueClaimBatchTx(t, ctx, pool, s, batch("queued"))
	assert.Equal(t, int64(0), n, "the batch's statement read every previous row")
	require.Len(t, got, len(want))
	for i := range want {
		id := batch("")[i].EventID
		assert.Equal(t, want[i].Outcome, got[i].Outcome, "claim %d (%s)", i, id)
		assert.Equal(t, want[i].Previous.Fingerprint, got[i].Previous.Fingerprint, "claim %d (%s) previous fingerprint", i, id)
		assert.Equal(t, want[i].Previous.ProcessedAt.IsZero(), got[i].Previous.ProcessedAt.IsZero(), "claim %d (%s) ProcessedAt", i, id)
	}
	assert.Equal(t, []dedup.Outcome{
		dedup.Claimed, dedup.Duplicate, dedup.Conflict, dedup.Claimed, dedup.Claimed,
		dedup.Duplicate, dedup.Duplicate, dedup.Claimed, dedup.Conflict, dedup.Duplicate,
	}, outcomes(got))

	for _, id := range []string{"new-1", "old-same", "old-diff", "rep", "new-2", "old-nil", "rep2"} {
		assert.Equal(t, stored(t, ctx, pool, "direct", id), stored(t, ctx, pool, "queued", id), "row of %s", id)
	}
	assert.Equal(t, 7, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events WHERE consumer = 'queued'`))
}

func outcomes(results []dedup.Result) []dedup.Outcome {
	out := make([]dedup.Outcome, len(results))
	for i, r := range results {
		out[i] = r.Outcome
	}
	return out
}

func TestQueueClaimRolledBackLeavesNoRow(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)

	b := beginBatch()
	one := s.QueueClaim(b, dedup.Claim{Consumer: "c", EventID: "one"})
	many, err := s.QueueClaimBatch(b, []dedup.Claim{{Consumer: "c", EventID: "a"}, {Consumer: "c", EventID: "b"}})
	require.NoError(t, err)
	br := pool.SendBatch(ctx, b)
	tx := br.Tx()
	defer tx.Rollback(ctx) //nolint:errcheck
	require.NoError(t, br.Close())
	r, err := one.Result(ctx, tx)
	require.NoError(t, err)
	assert.Equal(t, dedup.Claimed, r.Outcome)
	results, err := many.Results(ctx, tx)
	require.NoError(t, err)
	assert.Equal(t, []dedup.Result{{Outcome: dedup.Claimed}, {Outcome: dedup.Claimed}}, results)
	require.NoError(t, tx.Rollback(ctx))

	assert.Equal(t, 0, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`))
	r, _ = queueClaimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "one"})
	assert.Equal(t, dedup.Claimed, r.Outcome, "the id is free again")
}

// A batch that fails before the claims: Close reports the failure, and the
// pending claims report an error rather than an outcome.
func TestQueueClaimAfterFailingStatement(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)

	b := beginBatch()
	b.Queue("SELECT 1/0")
	one := s.QueueClaim(b, dedup.Claim{Consumer: "c", EventID: "one"})
	many, err := s.QueueClaimBatch(b, []dedup.Claim{{Consumer: "c", EventID: "a"}})
	require.NoError(t, err)
	br := pool.SendBatch(ctx, b)
	tx := br.Tx()
	defer tx.Rollback(ctx) //nolint:errcheck
	err = br.Close()
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	assert.Equal(t, "22012", pgErr.Code, "division by zero")

	r, err := one.Result(ctx, tx)
	require.Error(t, err)
	assert.Equal(t, "dedup: claim: the batch's result was not read", err.Error())
	assert.Equal(t, dedup.Result{}, r)
	results, err := many.Results(ctx, tx)
	require.Error(t, err)
	assert.Equal(t, "dedup: claim batch: the batch's result was not read", err.Error())
	assert.Nil(t, results)

	_ = tx.Rollback(ctx)
	assert.Equal(t, 0, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`))
}

// The claim's own statement fails (here: a check constraint rejects the
// id): the pending claim reports the statement's error.
func TestQueueClaimStatementFails(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	_, err := pool.Exec(ctx, `ALTER TABLE processed_events ADD CONSTRAINT no_bad CHECK (event_id <> 'bad')`)
	require.NoError(t, err)

	for _, queue := range []func(b *pgx.Batch) func(tx pgx.Tx) error{
		func(b *pgx.Batch) func(tx pgx.Tx) error {
			p := s.QueueClaim(b, dedup.Claim{Consumer: "c", EventID: "bad"})
			return func(tx pgx.Tx) error {
				r, err := p.Result(ctx, tx)
				assert.Equal(t, dedup.Result{}, r)
				return err
			}
		},
		func(b *pgx.Batch) func(tx pgx.Tx) error {
			p, err := s.QueueClaimBatch(b, []dedup.Claim{{Consumer: "c", EventID: "good"}, {Consumer: "c", EventID: "bad"}})
			require.NoError(t, err)
			return func(tx pgx.Tx) error {
				results, err := p.Results(ctx, tx)
				assert.Nil(t, results)
				return err
			}
		},
	} {
		func() {
			b := beginBatch()
			result := queue(b)
			br := pool.SendBatch(ctx, b)
			tx := br.Tx()
			defer tx.Rollback(ctx) //nolint:errcheck
			require.Error(t, br.Close())
			err := result(tx)
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr)
			assert.Equal(t, "23514", pgErr.Code, "check violation")
			assert.Regexp(t, `^dedup: claim( batch)?: `, err.Error())
		}()
	}
	assert.Equal(t, 0, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`))
}

func TestQueueClaimBatchMixedConsumersQueuesNothing(t *testing.T) {
	t.Parallel()
	_, _, s := setup(t)
	b := beginBatch()
	n := b.Len()
	pending, err := s.QueueClaimBatch(b, []dedup.Claim{
		{Consumer: "a", EventID: "1"},
		{Consumer: "b", EventID: "2"},
	})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "dedup: claim batch: mixed consumers")
	assert.Nil(t, pending)
	assert.Equal(t, n, len(b.QueuedQueries), "nothing queued")
}

func TestQueueClaimBatchEmpty(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	for _, claims := range [][]dedup.Claim{nil, {}} {
		b := beginBatch()
		pending, err := s.QueueClaimBatch(b, claims)
		require.NoError(t, err)
		assert.Equal(t, 1, b.Len(), "only the BEGIN")
		br := pool.SendBatch(ctx, b)
		tx := br.Tx()
		require.NoError(t, br.Close())
		db := &countingDB{DB: tx}
		results, err := pending.Results(ctx, db)
		assert.NoError(t, err)
		assert.Nil(t, results)
		assert.Equal(t, int64(0), db.n.Load())
		require.NoError(t, tx.Commit(ctx))
	}
}

// A batch that waits on another transaction's uncommitted claims, which
// then commits: the batch's statement cannot see those rows, so Result and
// Results look them up on the transaction, as Claim and ClaimBatch do.
func TestQueueClaimAfterConcurrentCommit(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	first, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer first.Rollback(ctx) //nolint:errcheck
	_, err = s.ClaimBatch(ctx, first, []dedup.Claim{
		{Consumer: "c", EventID: "x", Fingerprint: []byte("fx")},
		{Consumer: "c", EventID: "y", Fingerprint: []byte("fy")},
	})
	require.NoError(t, err)

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	pid := conn.Conn().PgConn().PID()
	// The batch statement waits on x, so its snapshot predates the commit;
	// the claim of y runs after it.
	b := beginBatch()
	many, err := s.QueueClaimBatch(b, []dedup.Claim{
		{Consumer: "c", EventID: "x", Fingerprint: []byte("other")},
		{Consumer: "c", EventID: "z"},
	})
	require.NoError(t, err)
	one := s.QueueClaim(b, dedup.Claim{Consumer: "c", EventID: "y", Fingerprint: []byte("fy")})
	closed := make(chan error, 1)
	br := conn.SendBatch(ctx, b)
	tx := br.Tx()
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	go func() { closed <- br.Close() }()

	waitBlocked(t, ctx, pool, pid)
	require.NoError(t, first.Commit(ctx))
	require.NoError(t, <-closed)

	db := &countingDB{DB: tx}
	r, err := one.Result(ctx, db)
	require.NoError(t, err)
	assert.Equal(t, dedup.Duplicate, r.Outcome)
	assert.Equal(t, []byte("fy"), r.Previous.Fingerprint)
	assert.Equal(t, int64(1), db.n.Load(), "the lookup of y")

	results, err := many.Results(ctx, db)
	require.NoError(t, err)
	require.Len(t, results, 2)
	assert.Equal(t, dedup.Conflict, results[0].Outcome, "x was committed by the other transaction with another fingerprint")
	assert.Equal(t, []byte("fx"), results[0].Previous.Fingerprint)
	assert.False(t, results[0].Previous.ProcessedAt.IsZero())
	assert.Equal(t, dedup.Claimed, results[1].Outcome)
	assert.Equal(t, int64(2), db.n.Load(), "x looked up (one statement for every id committed meanwhile)")
	require.NoError(t, tx.Commit(ctx))
	assert.Equal(t, 1, processed(t, ctx, pool, "c", "z"))
}

func TestQueueClaimQueryExecModes(t *testing.T) {
	t.Parallel()
	for _, mode := range execModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx, pool, s := setupExecMode(t, mode)

			c := dedup.Claim{Consumer: "c", EventID: "one", Fingerprint: []byte{0, 1, 0xff}, Source: "s", Partition: -1, Offset: 3}
			r, _ := queueClaimTx(t, ctx, pool, s, c)
			assert.Equal(t, dedup.Claimed, r.Outcome)
			r, _ = queueClaimTx(t, ctx, pool, s, c)
			assert.Equal(t, dedup.Duplicate, r.Outcome)
			assert.Equal(t, []byte{0, 1, 0xff}, r.Previous.Fingerprint)
			assert.Equal(t, storedRow{[]byte{0, 1, 0xff}, "s", nil, ptr[int64](3)}, stored(t, ctx, pool, "c", "one"))

			results, _ := queueClaimBatchTx(t, ctx, pool, s, []dedup.Claim{
				{Consumer: "c", EventID: "one", Fingerprint: []byte{9}},
				{Consumer: "c", EventID: "b1", Fingerprint: []byte{1}, Partition: -1, Offset: 4},
				{Consumer: "c", EventID: "b2", Fingerprint: nil, Source: "x", Partition: 5, Offset: -1},
				{Consumer: "c", EventID: "b1", Fingerprint: []byte{1}},
			})
			assert.Equal(t, []dedup.Outcome{dedup.Conflict, dedup.Claimed, dedup.Claimed, dedup.Duplicate}, outcomes(results))
			assert.Equal(t, storedRow{[]byte{1}, "", nil, ptr[int64](4)}, stored(t, ctx, pool, "c", "b1"))
			assert.Equal(t, storedRow{nil, "x", ptr[int32](5), nil}, stored(t, ctx, pool, "c", "b2"))

			// A batch of one source and partition (a Kafka partition's, a
			// queue's) sends them once: stored alike.
			results, _ = queueClaimBatchTx(t, ctx, pool, s, []dedup.Claim{
				{Consumer: "c", EventID: "k1", Fingerprint: []byte{1}, Source: "topic", Partition: 2, Offset: 10},
				{Consumer: "c", EventID: "b2", Fingerprint: nil, Source: "topic", Partition: 2, Offset: 11},
				{Consumer: "c", EventID: "k2", Fingerprint: []byte{2}, Source: "topic", Partition: 2, Offset: 12},
			})
			assert.Equal(t, []dedup.Outcome{dedup.Claimed, dedup.Duplicate, dedup.Claimed}, outcomes(results))
			assert.Equal(t, storedRow{[]byte{1}, "topic", ptr[int32](2), ptr[int64](10)}, stored(t, ctx, pool, "c", "k1"))
			assert.Equal(t, storedRow{[]byte{2}, "topic", ptr[int32](2), ptr[int64](12)}, stored(t, ctx, pool, "c", "k2"))
			results, _ = queueClaimBatchTx(t, ctx, pool, s, []dedup.Claim{
				{Consumer: "c", EventID: "q1", Fingerprint: []byte{3}, Source: "queue", Partition: -1, Offset: -1},
				{Consumer: "c", EventID: "q2", Fingerprint: []byte{4}, Source: "queue", Partition: -1, Offset: -1},
			})
			assert.Equal(t, []dedup.Outcome{dedup.Claimed, dedup.Claimed}, outcomes(results))
			assert.Equal(t, storedRow{[]byte{4}, "queue", nil, nil}, stored(t, ctx, pool, "c", "q2"))
		})
	}
}
