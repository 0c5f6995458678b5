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

// TestMessageWaitingToRetryLeavesItsSlotToOtherStreams: a message waiting
// between two attempts (its backoff, or the RetryAfter its handler asked
// for) runs no transaction, so it holds none of the Concurrency slots: the
// other streams go on meanwhile. (The wait held the slot: with Concurrency
// 1, one partition's message waiting for its retry, an hour away here,
// stopped every other partition for the hour.)
func TestMessageWaitingToRetryLeavesItsSlotToOtherStreams(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 2})
	other := keyOnAnotherStream("waiting", "other", 2)
	failed := make(chan struct{})
	var waitingRuns atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "waiting" && waitingRuns.Add(1) == 1 {
			close(failed)
			return consumer.RetryAfter(time.Hour, errors.New("not yet"))
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("retry-slot")
	cfg.Concurrency = 1
	cfg.Batch.Size = 1
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	publishKeyed(b, "waiting", "waiting", 0)
	select {
	case <-failed: // its retry is an hour away
	case <-time.After(20 * time.Second):
		t.Fatal("the first attempt did not run")
	}
	const others = 5
	for i := range others {
		publishKeyed(b, other, fmt.Sprintf("other-%d", i), i+1)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, others), "the other stream waits for the slot the retrying message holds")
	require.NoError(t, stop())
	assert.False(t, b.IsAcked(0), "the waiting message is abandoned at shutdown, for redelivery")
	assert.Equal(t, int32(1), waitingRuns.Load())
	requireEffectsOnce(t, pool, others)
}

// TestDeadLetterWaitingForItsDestinationLeavesItsSlotToOtherStreams: a
// poison message whose dead-letter destination is down waits there, and
// so does its stream (nothing after it is acked before it), but between
// its tries it holds none of the Concurrency slots: another stream goes
// on. (With Concurrency 1 the other stream waited for the destination.)
func TestDeadLetterWaitingForItsDestinationLeavesItsSlotToOtherStreams(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 2})
	other := keyOnAnotherStream("poison", "other", 2)
	b.SetDeadLetterError(errors.New("dead-letter queue unavailable"))
	cfg := fastConfig("dead-letter-slot")
	cfg.Concurrency = 1
	cfg.Batch.Size = 1
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	b.Publish(consumer.Message{Value: []byte("not json"), Headers: map[string]string{"id": "poison"}, Key: []byte("poison")})
	require.Eventually(t, func() bool { return c.Stats().InfraErrors >= 2 }, 20*time.Second, time.Millisecond,
		"the dead letter is tried again")
	const others = 5
	for i := range others {
		publishKeyed(b, other, fmt.Sprintf("other-%d", i), i+1)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, others), "the other stream waits for the slot the dead letter holds")
	assert.False(t, b.IsAcked(0), "no ack while the dead letter is not written")
	b.SetDeadLetterError(nil)
	require.NoError(t, b.WaitEachAcked(ctx, 1+others))
	assert.Len(t, b.DeadLetters(), 1)
	requireEffectsOnce(t, pool, others)
}

// TestUnorderedMessagesWaitingToRetryDoNotStopTheOthers: unordered
// messages waiting for their retry (an hour away here) run no
// transaction: with Concurrency of them waiting, the other messages are
// still handled, among them the one the waiting ones depend on. (Each
// waiting message kept its worker and its slot: with Concurrency 2, two
// of them stopped the consumer for the hour.) A twin of a waiting message
// still follows it, and nothing deadlocks.
func TestUnorderedMessagesWaitingToRetryDoNotStopTheOthers(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{})
	waiting := make(chan string, 2)
	var runs atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "waiting-1" || ev.ID == "waiting-2" {
			runs.Add(1)
			waiting <- ev.ID
			return consumer.RetryAfter(time.Hour, errors.New("its order is not there yet"))
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("unordered-retry-slot")
	cfg.Concurrency = 2
	cfg.Batch.Size = 1
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	publish(b, "waiting-1", 1)
	publish(b, "waiting-2", 2)
	for range 2 {
		select {
		case <-waiting: // its retry is an hour away
		case <-time.After(20 * time.Second):
			t.Fatal("the first attempts did not run")
		}
	}
	// Twins of the waiting messages follow them: they wait too, and must
	// not take the workers of the others.
	publish(b, "waiting-1", 1)
	publish(b, "waiting-2", 2)
	const others = 5
	for i := range others {
		publish(b, fmt.Sprintf("other-%d", i), 10+i)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, others), "the others wait for the workers the retrying messages hold")
	require.NoError(t, stop())
	for i := range 4 {
		assert.False(t, b.IsAcked(int64(i)), "a waiting message or its twin is abandoned at shutdown, for redelivery")
	}
	assert.Equal(t, int32(2), runs.Load(), "the twins ran before their first copies were settled")
	requireEffectsOnce(t, pool, others)
}
