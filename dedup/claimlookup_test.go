package dedup

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// The batch claim reads the previous row of the ids its insert did not
// take (the duplicates) and of no other: a claimed id has none, and the
// lookup cost an index probe for every id of every batch, most of them
// new in a healthy stream. Here 10 of 60 ids are duplicates, so the
// lookup runs 10 times, not 60.
func TestBatchClaimLooksUpOnlyTheDuplicates(t *testing.T) {
	ctx, pool, s := storeWithOldIDs(t)

	ids := make([]string, 0, 60)
	for i := 1; i <= 10; i++ {
		ids = append(ids, fmt.Sprintf("old-%d", i))
	}
	for i := 1; i <= 50; i++ {
		ids = append(ids, fmt.Sprintf("new-%d", i))
	}
	n := len(ids)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	rows, err := tx.Query(ctx, `EXPLAIN (ANALYZE, FORMAT TEXT) `+s.claimBatchSQL, "c", ids,
		make([][]byte, n), make([]string, n), make([]*int32, n), make([]*int64, n))
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	plan := strings.Join(lines, "\n")

	lookups := regexp.MustCompile(`Index (?:Only )?Scan using processed_events_pkey on processed_events[^\n]*loops=(\d+)`).
		FindStringSubmatch(plan)
	require.NotNil(t, lookups, "plan:\n%s", plan)
	loops, _ := strconv.Atoi(lookups[1])
	assert.Equal(t, 10, loops, "one lookup per duplicate; plan:\n%s", plan)
}

// Only the claims the insert did not take come back from the batch
// statement: a batch of new ids reads no result rows. Here 10 of 60.
func TestBatchClaimReturnsOnlyTheDuplicates(t *testing.T) {
	ctx, pool, s := storeWithOldIDs(t)

	var ids []string
	for i := 1; i <= 50; i++ {
		ids = append(ids, fmt.Sprintf("new-%d", i))
		if i%5 == 0 {
			ids = append(ids, fmt.Sprintf("old-%d", i/5))
		}
	}
	n := len(ids)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	rows, err := tx.Query(ctx, s.claimBatchSQL, "c", ids,
		make([][]byte, n), make([]string, n), make([]*int32, n), make([]*int64, n))
	require.NoError(t, err)
	var back []string
	for rows.Next() {
		vals, err := rows.Values()
		require.NoError(t, err)
		ord, ok := vals[0].(int64)
		require.True(t, ok, "ordinal %T", vals[0])
		back = append(back, ids[ord-1])
		assert.NotNil(t, vals[2], "%s: when the row that was there was processed", ids[ord-1])
	}
	require.NoError(t, rows.Err())
	assert.Len(t, back, 10, "rows back: %v", back)
	for _, id := range back {
		assert.True(t, strings.HasPrefix(id, "old-"), id)
	}
}

// storeWithOldIDs returns a migrated store in a schema of the test's own
// whose table holds the ids old-1 to old-10 of consumer c.
func storeWithOldIDs(t *testing.T) (context.Context, *pgxpool.Pool, *Store) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	pool, _ := pgtest.Schema(t)
	s, err := New(Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	_, err = pool.Exec(ctx, `INSERT INTO processed_events (consumer, event_id) SELECT 'c', 'old-' || i FROM generate_series(1, 10) i`)
	require.NoError(t, err)
	return ctx, pool, s
}
