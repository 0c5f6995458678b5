package consumer_test

import (
	"context"
	"errors"
	"fmt"
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
