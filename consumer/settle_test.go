package consumer

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// idleSource is a Source that delivers nothing.
type idleSource struct{}

func (idleSource) Receive(ctx context.Context) (Delivery, error) { <-ctx.Done(); return nil, ctx.Err() }
func (idleSource) Close() error                                  { return nil }

// A crash-guard record is written as values, so a write retried after its
// reply was lost counts once.
func TestCrashGuardWriteRetriedCountsOnce(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	c, err := New(pool, idleSource{}, func(context.Context, pgx.Tx, Event[struct{}]) error { return nil }, Config{Name: "guard-once"})
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, c.p.cfg.Store.Migrate(ctx, pool))
	j := &job{idt: identity{id: "e1"}, guard: guardState{suspect: true}}
	require.NoError(t, c.p.guard.startAttempt(ctx, j))
	// The same write again, as after a lost reply.
	require.NoError(t, c.p.guard.set(ctx, j, j.runs+1, j.guard.crashes, nil))
	records, ok := c.p.guard.read(ctx, c.p.guard.lookupSQL, []string{"e1"})
	require.True(t, ok)
	assert.Equal(t, record{runs: 1, crashes: 1}, records["e1"])
}

// An attempt of a suspect cut short without a crash (its delivery lost: a
// channel closed, a partition revoked) gives back exactly what its start
// recorded: the record is again what it was before, the runs of earlier
// processes (crashed runs, which count towards Retry.MaxAttempts) kept. It
// once took back one run more, so that every lost delivery erased a
// crashed run.
func TestLostAttemptGivesBackWhatItsStartRecorded(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	c, err := New(pool, idleSource{}, func(context.Context, pgx.Tx, Event[struct{}]) error { return nil }, Config{Name: "guard-lost"})
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, c.p.cfg.Store.Migrate(ctx, pool))
	// An earlier process crashed with e1 running alone once: runs 1, crashes 1.
	require.NoError(t, c.p.guard.set(ctx, &job{idt: identity{id: "e1"}}, 1, 1, nil))
	j := &job{idt: identity{id: "e1"}, guard: guardState{suspect: true, recorded: true}}
	require.NoError(t, c.p.guard.startAttempt(ctx, j))
	records, ok := c.p.guard.read(ctx, c.p.guard.lookupSQL, []string{"e1"})
	require.True(t, ok)
	require.Equal(t, record{runs: 2, crashes: 2}, records["e1"], "the attempt is recorded as a run and a crash")

	c.p.guard.forget(j) // the delivery was lost: not a crash
	records, ok = c.p.guard.read(ctx, c.p.guard.lookupSQL, []string{"e1"})
	require.True(t, ok)
	assert.Equal(t, record{runs: 1, crashes: 1}, records["e1"])
}

// A lane whose assignment ended (a revoked partition) retires once
// drained, and the dispatcher forgets it: a consumer whose partitions move
// keeps no lane or goroutine per partition it ever owned.
func TestLaneOfAnEndedAssignmentRetires(t *testing.T) {
	l := newLane()
	assignment, revoke := context.WithCancel(context.Background())
	revoke()
	assert.Nil(t, l.next(10, 0, assignment))
	assert.True(t, l.isRetired())
	assert.False(t, l.push(received{}), "a retired lane takes nothing")

	live := newLane()
	require.True(t, live.push(received{}))
	assert.Len(t, live.next(10, 0, context.Background()), 1)
	assert.False(t, live.isRetired())
}
