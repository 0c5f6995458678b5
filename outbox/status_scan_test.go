package outbox

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// An alert on the relay's lag read Status (docs/outbox.md: the age of its
// OldestPending) every minute or so, and Status counted the rows by state
// with one aggregate over the whole table: with RelayConfig.KeepSent, a
// week of sent rows (tens of millions) read at every call, for a handful
// of pending ones. Backlog, which the lag alert reads now, counts each
// state from its partial index: the table is never read sequentially
// (pg_stat_xact_user_tables, counted in the calling transaction), and
// its counts are those of the rows; Status adds the sent rows' count.
func TestBacklogReadsNoTableScanOnAFullTable(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	s, err := New(Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	_, err = pool.Exec(ctx, `
INSERT INTO outbox (event_id, topic, key, body, sent_at, created_at)
SELECT 'sent-' || i, 't', ('k' || i % 100)::bytea, convert_to(repeat('x', 200), 'UTF8'), now(), now() - interval '1 hour'
FROM generate_series(1, 30000) i;
INSERT INTO outbox (event_id, topic, key, body, attempts, parked_at, last_error) VALUES
    ('parked-1', 't', 'a', 'x', 3, now(), 'refused'), ('parked-2', 't', 'b', 'x', 3, now(), 'refused');
INSERT INTO outbox (event_id, topic, key, body, waiting, created_at) VALUES
    ('waiting-1', 't', 'a', 'x', true, now() - interval '3 minutes');
INSERT INTO outbox (event_id, topic, key, body, created_at) VALUES
    ('ready-1', 't', 'c', 'x', now() - interval '2 minutes'), ('ready-2', 't', 'd', 'x', now())`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `ANALYZE outbox`)
	require.NoError(t, err)

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	// The view also holds the session's counts not yet reported (those
	// of the statements before), which do not change inside a transaction.
	seqScans := func() int64 {
		var n int64
		require.NoError(t, tx.QueryRow(ctx, `SELECT coalesce(sum(seq_scan), 0) FROM pg_stat_xact_user_tables
	WHERE relid = 'outbox'::regclass`).Scan(&n))
		return n
	}
	before := seqScans()
	st, err := s.Backlog(ctx, tx)
	require.NoError(t, err)
	assert.Equal(t, before, seqScans(), "Backlog read the whole table")

	var oldestWaiting Status
	require.NoError(t, tx.QueryRow(ctx, `SELECT created_at FROM outbox WHERE event_id = 'waiting-1'`).Scan(&oldestWaiting.OldestPending))
	assert.Equal(t, int64(3), st.Pending, "ready and waiting rows")
	assert.Equal(t, int64(1), st.Waiting)
	assert.Equal(t, int64(2), st.Parked)
	assert.Zero(t, st.Sent, "Backlog does not count them")
	assert.True(t, st.OldestPending.Equal(oldestWaiting.OldestPending),
		"the oldest pending row is the waiting one: %v, want %v", st.OldestPending, oldestWaiting.OldestPending)

	full, err := s.Status(ctx, tx)
	require.NoError(t, err)
	want := st
	want.Sent = 30000
	assert.Equal(t, want, full)
}
