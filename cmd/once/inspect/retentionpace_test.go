package inspect_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/inspect"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// A DutyCycle of 0.1 leaves the table to the consumers nine tenths of the
// time: after each statement of the sweep, the next starts at least nine
// times that statement's duration later. (The sweep times a statement
// from before its call to after its row is read, which holds the span
// recorded here, so the bound is exact, not a guess at timing.)
func TestRetentionPacesItsStatementsByTheDutyCycle(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, pool))
	_, err = pool.Exec(ctx, `INSERT INTO processed_events (consumer, event_id, processed_at)
SELECT 'c1', 'e-' || i, now() - interval '30 days' FROM generate_series(1, 3000) i`)
	require.NoError(t, err)

	db := &timing{Pool: pool}
	n, err := inspect.Retention(ctx, db, inspect.Tables{}, "c1", time.Now().Add(-24*time.Hour),
		inspect.RetentionOptions{BatchSize: 500, DutyCycle: 0.1})
	require.NoError(t, err)
	assert.EqualValues(t, 3000, n)
	spans := db.reads()
	require.GreaterOrEqual(t, len(spans), 6, "a statement per batch of 500")
	for i := 1; i < len(spans); i++ {
		took := spans[i-1].end.Sub(spans[i-1].start)
		gap := spans[i].start.Sub(spans[i-1].end)
		assert.GreaterOrEqual(t, gap, 9*took, "statement %d took %v; the next came %v after it", i-1, took, gap)
	}
}

// A DutyCycle outside (0, 1] is refused before anything is deleted.
func TestRetentionRefusesADutyCycleOutOfRange(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	for _, d := range []float64{-0.5, 1.5} {
		_, err := inspect.Retention(ctx, pool, inspect.Tables{}, "c1", time.Now(), inspect.RetentionOptions{DutyCycle: d})
		require.Error(t, err, "duty cycle %v", d)
		assert.Contains(t, err.Error(), "duty cycle")
	}
}

// timing records when each of the sweep's reads (the statements on the
// processed-events table) began and when its row was read.
type timing struct {
	*pgxpool.Pool
	mu    sync.Mutex
	spans []span
}

type span struct{ start, end time.Time }

func (t *timing) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	start := time.Now()
	return &timedRow{Row: t.Pool.QueryRow(ctx, sql, args...), start: start, t: t}
}

func (t *timing) reads() []span {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]span(nil), t.spans...)
}

type timedRow struct {
	pgx.Row
	start time.Time
	t     *timing
}

func (r *timedRow) Scan(dest ...any) error {
	err := r.Row.Scan(dest...)
	r.t.mu.Lock()
	r.t.spans = append(r.t.spans, span{r.start, time.Now()})
	r.t.mu.Unlock()
	return err
}

// A consumer name PostgreSQL cannot store is refused alike with or without
// DryRun: the count sent PostgreSQL's encoding error (22021) instead.
func TestRetentionRefusesANameThatIsNotText(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, pool))
	for _, dry := range []bool{true, false} {
		_, err := inspect.Retention(ctx, pool, inspect.Tables{}, "bill\xffing", time.Now(), inspect.RetentionOptions{DryRun: dry})
		require.Error(t, err, "dry run %v", dry)
		assert.Contains(t, err.Error(), "not UTF-8 text", "dry run %v", dry)
	}
}
