package consumer_test

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
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

// memStream is the stream memsource gives a key among n streams.
func memStream(key string, n int) uint32 {
	h := fnv.New32a()
	h.Write([]byte(key))
	return h.Sum32() % uint32(n)
}

// TestBusyStreamDoesNotHoldUpOthers: a stream whose handler is stuck, with
// hundreds of messages queued behind it, must not stop other streams'
// messages from being received and handled while the receive buffer has
// room. (With a buffer per stream, receiving blocked on the stuck stream's
// full buffer, and every stream behind it in the source waited.)
func TestBusyStreamDoesNotHoldUpOthers(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 2})
	cold := keyOnAnotherStream("hot", "cold", 2)
	const hot, others = 300, 20
	for i := 0; i < hot; i++ {
		publishKeyed(b, "hot", fmt.Sprintf("hot-%d", i), i)
	}
	for i := 0; i < others; i++ {
		publishKeyed(b, cold, fmt.Sprintf("cold-%d", i), i)
	}

	release := make(chan struct{})
	var hotStarted atomic.Bool
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if string(ev.Message.Key) == "hot" {
			hotStarted.Store(true)
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("busy-stream")
	cfg.Batch.Size = 1
	cfg.ReceiveBuffer = 1000
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)

	// The streams run side by side: the hot one's first handler may start
	// after the cold stream is done, so wait for both, in either order.
	require.Eventually(t, func() bool { return hotStarted.Load() && c.Stats().Handled == others }, 20*time.Second,
		5*time.Millisecond, "the other stream's messages wait behind the stuck one")
	assert.Equal(t, 0, countEffects(t, pool)["hot-0"], "the stuck handler has not returned")

	close(release)
	require.Eventually(t, func() bool { return b.Acked() == hot+others }, 20*time.Second, 5*time.Millisecond)
	requireEffectsOnce(t, pool, hot+others)
}

// TestReceiveBufferBoundsWhatWaits: with every handler stuck, the consumer
// stops receiving once ReceiveBuffer messages wait (plus the one in each
// stuck handler and the one held by the receiver), instead of reading the
// whole backlog into memory.
func TestReceiveBufferBoundsWhatWaits(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := 0; i < 500; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	release := make(chan struct{})
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("receive-buffer")
	cfg.Batch.Size = 1
	cfg.ReceiveBuffer = 50
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)

	// 1 in the handler, 50 waiting, 1 held by the receiver waiting for room.
	require.Eventually(t, func() bool { return c.Stats().Received == 52 }, 20*time.Second, 5*time.Millisecond)
	assert.Never(t, func() bool { return c.Stats().Received > 52 }, 200*time.Millisecond, 5*time.Millisecond)
	close(release)
	require.Eventually(t, func() bool { return b.Acked() == 500 }, 20*time.Second, 5*time.Millisecond)
	assert.Len(t, countEffects(t, pool), 500)
}

// TestBacklogIdentifiedBesideTheRunningBatch: on a stream with a backlog,
// the next full batch is identified (decoded) while the batch before it
// runs, and the stream's order and effects stay exact. The first batch's
// handler waits until the decoder has seen a message of the second batch;
// a worker that identified batches only one after another would never
// let it. The look-ahead is decided as a batch starts, so the first
// message's decoding waits until a backlog of two batches was received:
// on a loaded machine the worker could otherwise start on the first
// messages before the rest reached the lane.
func TestBacklogIdentifiedBesideTheRunningBatch(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	const size, total = 20, 200
	for i := 0; i < total; i++ {
		publish(b, fmt.Sprintf("e%03d", i), i)
	}
	var decodedAhead atomic.Bool
	aheadSeen := make(chan struct{})
	var c *consumer.Consumer[order]
	backlog := func() bool { return c.Stats().Received > 2*size }
	cfg := fastConfig("look-ahead")
	cfg.Batch.Size = size
	cfg.Decoder = func(data []byte, v any) error {
		if err := json.Unmarshal(data, v); err != nil {
			return err
		}
		o, ok := v.(*order)
		if ok && o.N == 0 {
			for deadline := time.Now().Add(10 * time.Second); !backlog() && time.Now().Before(deadline); {
				time.Sleep(time.Millisecond)
			}
		}
		if ok && o.N >= size && decodedAhead.CompareAndSwap(false, true) {
			close(aheadSeen)
		}
		return nil
	}
	var overlapped atomic.Bool
	var last atomic.Int64
	last.Store(-1)
	var outOfOrder atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.Payload.N == 0 {
			select {
			case <-aheadSeen:
				overlapped.Store(true)
			case <-time.After(10 * time.Second):
			}
		}
		if int64(ev.Payload.N) <= last.Swap(int64(ev.Payload.N)) {
			outOfOrder.Add(1)
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.NoError(t, b.WaitAcked(t.Context(), total))
	assert.True(t, overlapped.Load(), "the second batch was decoded while the first ran")
	assert.Zero(t, outOfOrder.Load(), "handlers ran in stream order")
	requireEffectsOnce(t, pool, total)
}

// TestStopWithABatchIdentifiedAheadLosesNothing: a consumer stopped while
// a batch identified ahead waits for the one before leaves it unacked, and
// a new consumer handles everything exactly once.
func TestStopWithABatchIdentifiedAheadLosesNothing(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	const size, total = 20, 200
	for i := 0; i < total; i++ {
		publish(b, fmt.Sprintf("e%03d", i), i)
	}
	cfg := fastConfig("look-ahead-stop")
	cfg.Batch.Size = size
	running := make(chan struct{})
	release := make(chan struct{})
	var once atomic.Bool
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.Payload.N == size && once.CompareAndSwap(false, true) {
			close(running) // the second batch runs; the third was taken ahead
			<-release
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	<-running
	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	require.Eventually(t, func() bool { return consumer.Stopping(c) }, 5*time.Second, time.Millisecond)
	close(release)
	require.NoError(t, <-stopped)
	acked := b.Acked()
	assert.Less(t, acked, total, "what was identified ahead is not acked after the stop")

	c2, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c2)
	require.NoError(t, b.WaitAcked(t.Context(), total))
	requireEffectsOnce(t, pool, total)
}

// TestLaneWaitingForASlotTakesWhatArrivedMeanwhile: with more lanes than
// transaction slots (Config.Concurrency; KeyLanes does this), a lane that
// took a message and waits for a slot runs, once it has one, every message
// of its stream that arrived meanwhile in the same transaction, instead of
// the one message it took and then the rest.
func TestLaneWaitingForASlotTakesWhatArrivedMeanwhile(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 2})
	other := keyOnAnotherStream("a", "b", 2)
	entered, release := make(chan struct{}), make(chan struct{})
	var log commitLog
	cfg := fastConfig("slot-top-up")
	cfg.Concurrency = 1
	cfg.Batch.Size = 10
	cfg.Hooks.AfterCommit = log.hook
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "a-0" {
			close(entered)
			<-release
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	publishKeyed(b, "a", "a-0", 0)
	<-entered // the only slot is taken
	publishKeyed(b, other, "b-0", 1)
	require.Eventually(t, func() bool { return consumer.SlotWaiters(c) == 1 }, 10*time.Second, time.Millisecond,
		"the other lane took b-0 and waits for the slot")
	for i := 1; i < 5; i++ {
		publishKeyed(b, other, fmt.Sprintf("b-%d", i), 1+i)
	}
	// The dispatcher queues each delivery before it receives the next:
	// once a-1 is received, b-4 waits in its lane.
	publishKeyed(b, "a", "a-1", 9)
	require.Eventually(t, func() bool { return c.Stats().Received == 7 }, 10*time.Second, time.Millisecond)
	close(release)
	require.NoError(t, b.WaitAcked(t.Context(), 7))
	commits := log.transactions()
	assert.Contains(t, commits, []string{"b-0", "b-1", "b-2", "b-3", "b-4"}, "one transaction for the lane's messages")
	assert.Len(t, commits, 3)
	requireEffectsOnce(t, pool, 7)
}
