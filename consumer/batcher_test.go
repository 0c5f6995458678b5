package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// batchRecorder is a batch handler that records each batch's ids and
// blocks a batch holding the gate id until release is closed.
type batchRecorder struct {
	gate    string
	entered chan struct{}
	release chan struct{}

	mu      sync.Mutex
	batches [][]string
}

func newBatchRecorder(gate string) *batchRecorder {
	return &batchRecorder{gate: gate, entered: make(chan struct{}), release: make(chan struct{})}
}

func (r *batchRecorder) handle(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
	ids := make([]string, len(evs))
	for i, ev := range evs {
		ids[i] = ev.ID
		if ev.ID == r.gate {
			close(r.entered)
			select {
			case <-r.release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
	r.mu.Lock()
	r.batches = append(r.batches, ids)
	r.mu.Unlock()
	return nil
}

// transactionsOf counts the committed batches holding an id with prefix.
func (r *batchRecorder) transactionsOf(prefix string) (n, messages int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, b := range r.batches {
		k := 0
		for _, id := range b {
			if len(id) >= len(prefix) && id[:len(prefix)] == prefix {
				k++
			}
		}
		if k > 0 {
			n++
			messages += k
		}
	}
	return n, messages
}

// Unordered deliveries (RabbitMQ) that arrive while a transaction runs
// wait for it and go together into the next one, instead of each idle
// worker taking the one or two that wait when it is free: the stream is
// not split into as many small transactions as there are workers.
// (Before the batcher, 50 messages arriving during a transaction went into
// a dozen or more transactions of a few messages each.)
func TestUnorderedArrivalsDuringATransactionShareTheNext(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{}) // unordered, like AMQP
	rec := newBatchRecorder("gate")
	cfg := fastConfig("group-commit")
	cfg.Concurrency = 8
	c, err := consumer.NewBatch(pool, b.Source(), rec.handle, cfg)
	require.NoError(t, err)
	start(t, c)

	publish(b, "gate", 0)
	<-rec.entered
	for i := 1; i <= 50; i++ {
		publish(b, fmt.Sprintf("after-%d", i), i)
	}
	require.Eventually(t, func() bool { return c.Stats().Received == 51 }, 10*time.Second, time.Millisecond)
	close(rec.release)
	require.NoError(t, b.WaitAcked(context.Background(), 51))

	n, messages := rec.transactionsOf("after-")
	assert.Equal(t, 50, messages)
	// One when the batcher received all 50 within maxGroupWait of the
	// first; a loaded machine may close the batch once or twice early.
	assert.LessOrEqual(t, n, 3, "transactions of the 50 messages that arrived during one")
}

// A transaction that does not end (a handler stuck on something outside
// the database) holds up the unordered messages behind it only for a
// bounded time: a partial batch stops waiting for it and runs beside it.
func TestUnorderedBatchesDoNotWaitForAStuckTransaction(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{})
	rec := newBatchRecorder("stuck")
	cfg := fastConfig("group-commit-stuck")
	cfg.Concurrency = 4
	c, err := consumer.NewBatch(pool, b.Source(), rec.handle, cfg)
	require.NoError(t, err)
	start(t, c)
	defer close(rec.release)

	publish(b, "stuck", 0)
	<-rec.entered
	for round := 1; round <= 3; round++ {
		for i := 1; i <= 5; i++ {
			publish(b, fmt.Sprintf("next-%d-%d", round, i), i)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := b.WaitAcked(ctx, 5*round)
		cancel()
		require.NoError(t, err, "round %d: handled while the stuck transaction runs", round)
	}
	_, messages := rec.transactionsOf("next-")
	assert.Equal(t, 15, messages)
}

// alternating reads its sources in turn, one delivery each: the
// deliveries of two channels arrive interleaved, as from a source that
// reads several channels.
type alternating struct {
	srcs []consumer.Source
	next int
}

func (a *alternating) Receive(ctx context.Context) (consumer.Delivery, error) {
	s := a.srcs[a.next%len(a.srcs)]
	a.next++
	return s.Receive(ctx)
}

func (a *alternating) Close() error {
	for _, s := range a.srcs {
		_ = s.Close()
	}
	return nil
}

// Unordered deliveries of two channels that arrive interleaved share a
// transaction per channel, instead of the batch being cut wherever the
// channel changes (a transaction per delivery here). A transaction still
// never mixes channels: each has one fate.
func TestInterleavedChannelsShareTransactions(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	a, b := memsource.New(memsource.Options{}), memsource.New(memsource.Options{})
	rec := newBatchRecorder("gate")
	cfg := fastConfig("interleaved")
	cfg.Concurrency = 8
	c, err := consumer.NewBatch(pool, &alternating{srcs: []consumer.Source{a.Source(), b.Source()}}, rec.handle, cfg)
	require.NoError(t, err)
	start(t, c)

	publish(a, "gate", 0)
	<-rec.entered
	for i := 1; i <= 50; i++ {
		publish(b, fmt.Sprintf("b-%d", i), i)
		publish(a, fmt.Sprintf("a-%d", i), i)
	}
	require.Eventually(t, func() bool { return c.Stats().Received == 101 }, 10*time.Second, time.Millisecond)
	close(rec.release)
	require.NoError(t, a.WaitAcked(context.Background(), 51))
	require.NoError(t, b.WaitAcked(context.Background(), 50))

	na, ma := rec.transactionsOf("a-")
	nb, mb := rec.transactionsOf("b-")
	assert.Equal(t, 50, ma)
	assert.Equal(t, 50, mb)
	// One each when the batcher received all within maxGroupWait of the
	// first; a loaded machine may close the batch once or twice early.
	assert.LessOrEqual(t, na, 3, "transactions of channel a's 50 messages")
	assert.LessOrEqual(t, nb, 3, "transactions of channel b's 50 messages")
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, batch := range rec.batches {
		for _, id := range batch {
			assert.Equal(t, batch[0][0], id[0], "one channel per transaction: %v", batch)
		}
	}
}

// A batch waiting aside (its retry an hour away) runs no transaction, and
// the batcher does not count it as one: deliveries that come meanwhile
// close at once when no other transaction runs, as on a light stream, and
// do not wait for the average transaction's time, up to maxGroupWait,
// behind a transaction that is not there. (The batcher counted the
// waiting batch as running for the whole hour.)
func TestABatchWaitingAsideIsNotARunningTransaction(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{})
	waiting := make(chan struct{}, 1)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "waiting" {
			waiting <- struct{}{}
			return consumer.RetryAfter(time.Hour, errors.New("its order is not there yet"))
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("aside-not-running")
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	publish(b, "waiting", 0)
	select {
	case <-waiting:
	case <-time.After(20 * time.Second):
		t.Fatal("the first attempt did not run")
	}
	require.Eventually(t, func() bool { return consumer.UnorderedRunning(c) == 0 }, 10*time.Second, time.Millisecond,
		"the waiting batch is counted as a running transaction")
	publish(b, "next", 1)
	require.NoError(t, b.WaitAcked(context.Background(), 1))
	assert.Equal(t, map[string]int{"next": 1}, countEffects(t, pool))
}
