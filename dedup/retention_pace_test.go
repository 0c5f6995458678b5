package dedup_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
)

// statementLog is a dedup.DB that records when each statement started and
// ended, as seen from outside the store.
type statementLog struct {
	*pgxpool.Pool
	mu    sync.Mutex
	spans [][2]time.Time
}

func (l *statementLog) record(start time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.spans = append(l.spans, [2]time.Time{start, time.Now()})
}

func (l *statementLog) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	start := time.Now()
	defer l.record(start)
	return l.Pool.Exec(ctx, sql, args...)
}

func (l *statementLog) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return &timedRow{log: l, start: time.Now(), row: l.Pool.QueryRow(ctx, sql, args...)}
}

// timedRow ends its statement at Scan, when pgx has read the result.
type timedRow struct {
	log   *statementLog
	start time.Time
	row   pgx.Row
}

func (r *timedRow) Scan(dest ...any) error {
	defer r.log.record(r.start)
	return r.row.Scan(dest...)
}

// Under DutyCycle(share), the sweep waits after each statement at least
// (1 - share) / share times as long as the statement took, and still
// deletes every expired row.
func TestDutyCyclePacesTheSweep(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	for i := range 10 {
		claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "billing", EventID: fmt.Sprintf("evt-%d", i)})
	}
	_, err := pool.Exec(ctx, `UPDATE processed_events SET processed_at = now() - interval '2 days'`)
	require.NoError(t, err)

	const share = 0.25
	log := &statementLog{Pool: pool}
	n, err := s.DeleteOlderThan(ctx, log, "billing", time.Now().Add(-time.Hour), 3, dedup.DutyCycle(share))
	require.NoError(t, err)
	assert.Equal(t, int64(10), n)
	assert.Zero(t, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`))

	// 10 rows in batches of 3: four statements on processed_events, then
	// one on the attempts table.
	require.Len(t, log.spans, 5)
	for i := 1; i < 4; i++ {
		took := log.spans[i-1][1].Sub(log.spans[i-1][0])
		gap := log.spans[i][0].Sub(log.spans[i-1][1])
		assert.GreaterOrEqual(t, gap, time.Duration(float64(took)*(1-share)/share),
			"statement %d: the sweep paused at least (1-share)/share of the statement's time", i)
	}
}

// A duty cycle outside (0, 1] is refused before anything is deleted.
func TestDutyCycleOutOfRangeIsRefused(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "billing", EventID: "evt"})
	for _, share := range []float64{0, -0.5, 1.5} {
		_, err := s.DeleteOlderThan(ctx, pool, "billing", time.Now().Add(time.Hour), 10, dedup.DutyCycle(share))
		require.Error(t, err, "share %v", share)
		assert.Contains(t, err.Error(), "DutyCycle")
	}
	assert.Equal(t, 1, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events`), "nothing was deleted")
}

// A duty cycle so small that the pause after a statement exceeds what a
// time.Duration holds still pauses (until ctx ends), rather than wrapping
// round to a negative pause and sweeping at full speed.
func TestTinyDutyCyclePausesTheSweep(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	for i := range 10 {
		claimTx(t, ctx, pool, s, dedup.Claim{Consumer: "billing", EventID: fmt.Sprintf("evt-%d", i)})
	}
	_, err := pool.Exec(ctx, `UPDATE processed_events SET processed_at = now() - interval '2 days'`)
	require.NoError(t, err)

	sweep, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	log := &statementLog{Pool: pool}
	n, err := s.DeleteOlderThan(sweep, log, "billing", time.Now().Add(-time.Hour), 3, dedup.DutyCycle(1e-15))
	require.ErrorIs(t, err, context.DeadlineExceeded, "the sweep paused after its first statement")
	assert.Equal(t, int64(3), n)
	assert.Len(t, log.spans, 1)
}
