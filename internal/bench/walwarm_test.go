package bench

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtemp"
)

// TestWarmWALLeavesSegmentsAhead: a fresh cluster has no WAL segment
// beyond the one it writes, so its next segment is created and zero-filled
// while commits wait; after warmWAL the segments it switched through are
// recycled into segments ahead of the write position.
func TestWarmWALLeavesSegmentsAhead(t *testing.T) {
	ctx := context.Background()
	srv, err := pgtemp.Start(ctx, pgtemp.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })
	db, err := pgxpool.New(ctx, srv.URL())
	require.NoError(t, err)
	t.Cleanup(db.Close)

	conn, err := db.Acquire(ctx)
	require.NoError(t, err)
	before, err := walSegmentsAhead(ctx, conn.Conn())
	conn.Release()
	require.NoError(t, err)
	require.LessOrEqual(t, before, 1, "a fresh cluster")

	w, err := warmWAL(ctx, db, 8)
	require.NoError(t, err)
	require.Equal(t, 8, w.Made)
	require.Equal(t, 16, w.SegmentMB)
	require.GreaterOrEqual(t, w.Ready, 7, "the segments switched through are recycled ahead")

	var leftover bool
	require.NoError(t, db.QueryRow(ctx, `SELECT to_regclass('oncebench_walwarm') IS NOT NULL`).Scan(&leftover))
	require.False(t, leftover, "the table written to is dropped")
}
