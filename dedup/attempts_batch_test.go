package dedup_test

import (
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
)

func TestAttemptsInBatches(t *testing.T) {
	ctx, pool, s := setup(t)
	claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "c", EventID: "done", Partition: -1, Offset: -1})

	got, err := s.Attempts(ctx, pool, "c", []string{"a", "b"})
	require.NoError(t, err)
	assert.Empty(t, got, "nothing counted yet")

	got, err = s.RecordAttempts(ctx, pool, "c", []string{"a", "b", "a", "done"})
	require.NoError(t, err)
	assert.Equal(t, map[string]int{"a": 1, "b": 1}, got, "a repeated id counts once; a processed id not at all")

	got, err = s.RecordAttempts(ctx, pool, "c", []string{"b", "a"})
	require.NoError(t, err)
	assert.Equal(t, map[string]int{"a": 2, "b": 2}, got)
	got, err = s.Attempts(ctx, pool, "c", []string{"a", "b", "zzz"})
	require.NoError(t, err)
	assert.Equal(t, map[string]int{"a": 2, "b": 2}, got, "reading does not count")
	other, err := s.Attempts(ctx, pool, "other-consumer", []string{"a"})
	require.NoError(t, err)
	assert.Empty(t, other)

	// Cleared only when the clearing transaction commits.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, s.ClearAttemptsBatch(ctx, tx, "c", []string{"a", "b"}))
	require.NoError(t, tx.Rollback(ctx))
	got, err = s.Attempts(ctx, pool, "c", []string{"a", "b"})
	require.NoError(t, err)
	assert.Len(t, got, 2)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return s.ClearAttemptsBatch(ctx, tx, "c", []string{"a", "b"})
	}))
	got, err = s.Attempts(ctx, pool, "c", []string{"a", "b"})
	require.NoError(t, err)
	assert.Empty(t, got)
}

func TestUnrecordAttempt(t *testing.T) {
	ctx, pool, s := setup(t)
	n, err := s.RecordAttempt(ctx, pool, "c", "e")
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.NoError(t, s.UnrecordAttempt(ctx, pool, "c", "e"))
	got, err := s.Attempts(ctx, pool, "c", []string{"e"})
	require.NoError(t, err)
	assert.Empty(t, got, "a count taken back to zero is no evidence of a crash")
	require.NoError(t, s.UnrecordAttempt(ctx, pool, "c", "e"), "no count left: a no-op")
	n, err = s.RecordAttempt(ctx, pool, "c", "e")
	require.NoError(t, err)
	assert.Equal(t, 1, n, "counting starts again from zero")
}
