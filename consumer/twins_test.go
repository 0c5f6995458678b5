package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// twinGate is a handler whose first call for the id "first" blocks until
// release is closed and then returns fail (nil: it succeeds).
type twinGate struct {
	entered, release chan struct{}
	fail             error
	calls            atomic.Int32
}

func newTwinGate(fail error) *twinGate {
	return &twinGate{entered: make(chan struct{}), release: make(chan struct{}), fail: fail}
}

func (g *twinGate) handle(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
	if ev.ID == "first" && g.calls.Add(1) == 1 {
		close(g.entered)
		select {
		case <-g.release:
		case <-ctx.Done():
			return ctx.Err()
		}
		if g.fail != nil {
			return g.fail
		}
	}
	return insertEffect(ctx, tx, ev)
}

// runTwins publishes "first" in a batch of six, holds its handler, then
// publishes a copy of it with five other messages, which form the second
// batch. The copy is offset 6.
func runTwins(t *testing.T, g *twinGate) (*memsource.Broker, *consumer.Consumer[order]) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{}) // unordered, like AMQP
	publish(b, "first", 1)
	for i := 0; i < 5; i++ {
		publish(b, fmt.Sprintf("before-%d", i), 20+i)
	}
	cfg := fastConfig("twins")
	cfg.Concurrency = 4
	cfg.Batch.Size = 6
	cfg.Batch.Linger = time.Minute // batches close when full
	c, err := consumer.New(pool, b.Source(), g.handle, cfg)
	require.NoError(t, err)
	start(t, c)
	<-g.entered
	publish(b, "first", 1) // a copy while the first is in flight
	for i := 0; i < 5; i++ {
		publish(b, fmt.Sprintf("other-%d", i), 10+i)
	}
	t.Cleanup(func() { requireEffectsOnce(t, pool, 11) })
	return b, c
}

// An unordered message whose id another batch is claiming at the same
// time does not make its own batch wait for that batch in the database:
// the other messages of its batch commit and are acked while the first
// copy's transaction is still open (its claim would have waited on the
// first copy's uncommitted row, holding them all), and the copy is acked as
// a duplicate once the first has committed, without a claim of its own.
func TestTwinInFlightDoesNotHoldItsBatch(t *testing.T) {
	g := newTwinGate(nil)
	b, c := runTwins(t, g)
	require.Eventually(t, func() bool { return b.Acked() == 5 }, 10*time.Second, 5*time.Millisecond,
		"the others of the copy's batch are acked while the first copy runs")
	assert.False(t, b.IsAcked(0), "the first copy is still running")
	assert.False(t, b.IsAcked(6), "the copy waits for the first")
	close(g.release)
	require.NoError(t, b.WaitAcked(context.Background(), 12))
	assert.Equal(t, int32(1), g.calls.Load(), "the handler ran once for the id")
	assert.Equal(t, uint64(1), c.Stats().Duplicates)
	assert.Empty(t, b.DeadLetters())
}

// When the copy in flight does not commit (here: its handler fails for
// good and it is dead-lettered), the copy that followed it is claimed and
// run like any message.
func TestTwinThatFailsLetsTheFollowerRun(t *testing.T) {
	g := newTwinGate(consumer.Permanent(errors.New("rejected the first time")))
	b, c := runTwins(t, g)
	require.Eventually(t, func() bool { return b.Acked() == 5 }, 10*time.Second, 5*time.Millisecond)
	close(g.release)
	require.NoError(t, b.WaitAcked(context.Background(), 12))
	assert.Equal(t, int32(2), g.calls.Load(), "the follower ran after its twin failed")
	require.Len(t, b.DeadLetters(), 1)
	assert.Zero(t, c.Stats().Duplicates)
}

// A copy that follows a twin skipped as an id conflict (SkipConflicts) is
// an id conflict too, skipped with its warning, not a duplicate: the id's
// committed row is the earlier payload's, not the twin's.
func TestTwinSkippedAsAConflictLeavesTheFollowerAConflict(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{}) // unordered, like AMQP
	cfg := fastConfig("twin-conflict")
	cfg.Identify.OnConflict = consumer.SkipConflicts
	var mu sync.Mutex
	results := map[int64]consumer.Result{}
	reported := make(chan struct{}, 8)
	cfg.Hooks.OnOutcome = func(_ context.Context, o consumer.Outcome) {
		mu.Lock()
		results[o.Message.Offset] = o.Result
		mu.Unlock()
		reported <- struct{}{}
	}

	// The id's row, committed with the payload n=0.
	publish(b, "first", 0)
	c0, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	stop0 := start(t, c0)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, 1))
	require.NoError(t, stop0())

	// Two copies with n=1, the second while the first's batch is open: a
	// message of its batch is held in its handler.
	entered, release := make(chan struct{}), make(chan struct{})
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "slow" {
			close(entered)
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return insertEffect(ctx, tx, ev)
	}
	publish(b, "first", 1) // offset 1
	publish(b, "slow", 2)
	cfg.Concurrency = 4
	cfg.Batch.Size = 2
	cfg.Batch.Linger = time.Minute // batches close when full
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	<-entered
	publish(b, "first", 1) // offset 3: follows the copy at offset 1
	publish(b, "other", 3)
	require.Eventually(t, func() bool { return b.IsAcked(4) }, 10*time.Second, 5*time.Millisecond,
		"the other message of the follower's batch is acked while its twin's batch is open")
	close(release)
	for range 5 { // OnOutcome runs after the ack: wait for it
		select {
		case <-reported:
		case <-ctx.Done():
			t.Fatal("not every outcome was reported")
		}
	}
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, consumer.ResultSkipped, results[1], "the first copy is a conflict")
	assert.Equal(t, consumer.ResultSkipped, results[3], "its follower is a conflict too")
	assert.Equal(t, uint64(2), c.Stats().Skipped)
	assert.Zero(t, c.Stats().Duplicates)
	assert.Equal(t, map[string]int{"first": 1, "slow": 1, "other": 1}, countEffects(t, pool))
}
