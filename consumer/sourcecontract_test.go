package consumer_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// brokenSource is a custom Source that passes good deliveries through
// until it has passed good, then breaks its contract the way breaks
// says at each Receive.
type brokenSource struct {
	consumer.Source
	good   int64
	passed atomic.Int64
	breaks string // "nil delivery", "nil message", "panic"
}

type nilMessageDelivery struct{ consumer.Delivery }

func (nilMessageDelivery) Message() *consumer.Message { return nil }

func (s *brokenSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	if s.passed.Load() < s.good {
		dv, err := s.Source.Receive(ctx)
		if err == nil {
			s.passed.Add(1)
		}
		return dv, err
	}
	switch s.breaks {
	case "nil delivery":
		return nil, nil
	case "nil message":
		dv, err := s.Source.Receive(ctx)
		if err != nil {
			return nil, err
		}
		return nilMessageDelivery{dv}, nil
	default:
		panic("source bug")
	}
}

// A custom Source that breaks its contract (Receive returning neither a
// delivery nor an error, a delivery without a message) or panics in
// Receive stops the consumer with an error naming what it did, and loses
// nothing (the deliveries it had not settled are delivered again): it
// crashed the process with a nil pointer
// dereference or the panic, on Run's goroutine, with the consumer's other
// goroutines left running.
func TestSourceBreakingItsContractStopsTheConsumerWithAnError(t *testing.T) {
	for _, breaks := range []string{"nil delivery", "nil message", "panic"} {
		t.Run(breaks, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "e1", 1)
			publish(b, "e2", 2)
			src := &brokenSource{Source: b.Source(), good: 1, breaks: breaks}
			c, err := consumer.New(pool, src, insertEffect, fastConfig("broken-source"))
			require.NoError(t, err)
			done := make(chan error, 1)
			go func() { done <- c.Run(context.Background()) }()
			select {
			case err := <-done:
				require.Error(t, err)
				assert.Contains(t, err.Error(), breaks)
				assert.ErrorIs(t, err, consumer.ErrSourceBroken)
			case <-time.After(30 * time.Second):
				t.Fatal("Run did not return")
			}
			// Nothing is lost: a consumer on a source that keeps the
			// contract handles every message once.
			c, err = consumer.New(pool, b.Source(), insertEffect, fastConfig("broken-source"))
			require.NoError(t, err)
			stop := start(t, c)
			require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 2))
			require.NoError(t, stop())
			assert.Equal(t, map[string]int{"e1": 1, "e2": 1}, countEffects(t, pool))
		})
	}
}

// deadline is a context that ends after d or with the test.
func deadline(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// panickySource passes deliveries through whose Ack panics the first
// time it is called.
type panickySource struct {
	consumer.Source
	panicked atomic.Bool
}

type panickyAckDelivery struct {
	consumer.Delivery
	s *panickySource
}

func (d panickyAckDelivery) Ack(ctx context.Context) error {
	if d.s.panicked.CompareAndSwap(false, true) {
		panic("ack bug")
	}
	return d.Delivery.Ack(ctx)
}

func (s *panickySource) Receive(ctx context.Context) (consumer.Delivery, error) {
	dv, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return panickyAckDelivery{dv, s}, nil
}

// A panic in a custom Delivery's Ack is an ack that failed: the consumer
// goes on, the message's claim is committed, and its redelivery is
// skipped as a duplicate. It crashed the process.
func TestSourceAckPanicIsAFailedAck(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e1", 1)
	publish(b, "e2", 2)
	src := &panickySource{Source: b.Source()}
	c, err := consumer.New(pool, src, insertEffect, fastConfig("panicky-ack"))
	require.NoError(t, err)
	stop := start(t, c)
	require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 1))
	require.NoError(t, stop())
	assert.True(t, src.panicked.Load())
	c, err = consumer.New(pool, b.Source(), insertEffect, fastConfig("panicky-ack"))
	require.NoError(t, err)
	stop = start(t, c)
	require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 2))
	require.NoError(t, stop())
	assert.Equal(t, map[string]int{"e1": 1, "e2": 1}, countEffects(t, pool))
}

// panickyDLSource passes deliveries through whose DeadLetter panics the
// first two times it is called.
type panickyDLSource struct {
	consumer.Source
	panics atomic.Int32
}

type panickyDLDelivery struct {
	consumer.Delivery
	s *panickyDLSource
}

func (d panickyDLDelivery) DeadLetter(ctx context.Context, dl *consumer.DeadLetter) error {
	if d.s.panics.Add(1) <= 2 {
		panic("dead-letter bug")
	}
	return d.Delivery.DeadLetter(ctx, dl)
}

func (s *panickyDLSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	dv, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return panickyDLDelivery{dv, s}, nil
}

// A panic in a custom Delivery's DeadLetter is a dead letter not written:
// retried, and the message acked only once it is written. It crashed the
// process.
func TestSourceDeadLetterPanicIsRetried(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1})
	b.Publish(consumer.Message{Value: []byte("not json"), Headers: map[string]string{"id": "poison"}})
	src := &panickyDLSource{Source: b.Source()}
	c, err := consumer.New(pool, src, insertEffect, fastConfig("panicky-dl"))
	require.NoError(t, err)
	stop := start(t, c)
	require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 1))
	require.NoError(t, stop())
	assert.Equal(t, int32(3), src.panics.Load())
	assert.Len(t, b.DeadLetters(), 1)
	assert.GreaterOrEqual(t, c.Stats().InfraErrors, uint64(2))
}
