package consumer_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
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
	// breaks is "nil delivery", "nil message", "panic" (in Receive),
	// "Message panicked", "nil context", "Context panicked" or
	// "DeduplicatedByPosition panicked".
	breaks string
}

type nilMessageDelivery struct{ consumer.Delivery }

func (nilMessageDelivery) Message() *consumer.Message { return nil }

type panickyMessageDelivery struct{ consumer.Delivery }

func (panickyMessageDelivery) Message() *consumer.Message { panic("message bug") }

type nilContextDelivery struct{ consumer.Delivery }

func (nilContextDelivery) Context() context.Context { return nil }

type panickyContextDelivery struct{ consumer.Delivery }

func (panickyContextDelivery) Context() context.Context { panic("context bug") }

type panickyPositionDelivery struct{ consumer.Delivery }

func (panickyPositionDelivery) DeduplicatedByPosition() bool { panic("position bug") }

func (s *brokenSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	if s.passed.Load() < s.good {
		dv, err := s.Source.Receive(ctx)
		if err == nil {
			s.passed.Add(1)
		}
		return dv, err
	}
	if s.breaks == "nil delivery" {
		return nil, nil
	}
	if s.breaks == "panic" {
		panic("source bug")
	}
	dv, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	switch s.breaks {
	case "nil message":
		return nilMessageDelivery{dv}, nil
	case "Message panicked":
		return panickyMessageDelivery{dv}, nil
	case "nil context":
		return nilContextDelivery{dv}, nil
	case "Context panicked":
		return panickyContextDelivery{dv}, nil
	default:
		return panickyPositionDelivery{dv}, nil
	}
}

// A custom Source that breaks its contract (Receive returning neither a
// delivery nor an error, a delivery without a message or without a
// context) or panics in Receive or in a delivery's Message, Context or
// DeduplicatedByPosition stops the consumer with an error naming what it
// did, and loses nothing (the deliveries it had not settled are delivered
// again), on ordered streams and unordered alike: it crashed the process
// with a nil pointer dereference or the panic, on Run's goroutine or on a
// worker's.
func TestSourceBreakingItsContractStopsTheConsumerWithAnError(t *testing.T) {
	for _, breaks := range []string{"nil delivery", "nil message", "panic", "Message panicked",
		"nil context", "Context panicked", "DeduplicatedByPosition panicked"} {
		for _, streams := range []int{1, 0} {
			t.Run(fmt.Sprintf("%s/streams=%d", breaks, streams), func(t *testing.T) {
				brokenSourceStopsRun(t, breaks, streams)
			})
		}
	}
}

// brokenSourceStopsRun runs a consumer on a brokenSource that breaks on
// the second message and checks that Run stops with ErrSourceBroken, then
// that a consumer on a good source handles both messages once.
func brokenSourceStopsRun(t *testing.T, breaks string, streams int) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: streams, FallbackID: true})
	want := map[string]int{"e1": 1, "e2": 1}
	if breaks == "DeduplicatedByPosition panicked" {
		// Without ids of their own: their position is their id.
		b.Publish(consumer.Message{Value: []byte(`{"n":1}`)})
		b.Publish(consumer.Message{Value: []byte(`{"n":2}`)})
		want = map[string]int{"mem/0": 1, "mem/1": 1}
	} else {
		publish(b, "e1", 1)
		publish(b, "e2", 2)
	}
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
	// Nothing is lost: a consumer on a source that keeps the contract
	// handles every message once.
	c, err = consumer.New(pool, b.Source(), insertEffect, fastConfig("broken-source"))
	require.NoError(t, err)
	stop := start(t, c)
	require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 2))
	require.NoError(t, stop())
	assert.Equal(t, want, countEffects(t, pool))
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

// askedOnceSource passes deliveries through whose Message, Context and
// DeduplicatedByPosition answer their first call and panic at any later
// one.
type askedOnceSource struct {
	consumer.Source
	again atomic.Int32 // later calls
}

type askedOnceDelivery struct {
	consumer.Delivery
	s     *askedOnceSource
	calls *[3]atomic.Int32
}

func (d askedOnceDelivery) ask(i int, method string) {
	if d.calls[i].Add(1) > 1 {
		d.s.again.Add(1)
		panic(method + " called again")
	}
}

func (d askedOnceDelivery) Message() *consumer.Message {
	d.ask(0, "Message")
	return d.Delivery.Message()
}

func (d askedOnceDelivery) Context() context.Context {
	d.ask(1, "Context")
	return d.Delivery.Context()
}

func (d askedOnceDelivery) DeduplicatedByPosition() bool {
	d.ask(2, "DeduplicatedByPosition")
	return false
}

func (s *askedOnceSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	dv, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return askedOnceDelivery{dv, s, new([3]atomic.Int32)}, nil
}

// The consumer asks a custom Delivery for its Message, its Context and
// whether it is DeduplicatedByPosition once, when it receives it, and
// keeps the answers: a later call that panics cannot crash the process.
// It called Message and Context again at every stage (dispatch, lanes,
// batches, the transaction), on the workers' goroutines, unguarded.
func TestDeliveryMethodsAreAskedOnce(t *testing.T) {
	for _, streams := range []int{2, 0} {
		t.Run(fmt.Sprintf("streams=%d", streams), func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: streams})
			want := map[string]int{}
			for i := range 20 {
				id := fmt.Sprintf("e%d", i)
				publish(b, id, i)
				want[id] = 1
			}
			src := &askedOnceSource{Source: b.Source()}
			c, err := consumer.New(pool, src, insertEffect, fastConfig("asked-once"))
			require.NoError(t, err)
			stop := start(t, c)
			require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 20))
			require.NoError(t, stop())
			assert.Zero(t, src.again.Load(), "no method was called twice")
			assert.Equal(t, want, countEffects(t, pool))
		})
	}
}

// panickyProgressSource is a progressSource whose hook named panics
// panics at its first left calls. Its deliveries are deduplicated by
// position and know every first position done (FirstPositionDone).
type panickyProgressSource struct {
	*progressSource
	panics string
	left   atomic.Int32
}

func (s *panickyProgressSource) hook(method string) {
	if s.panics == method && s.left.Add(-1) >= 0 {
		panic(method + " bug")
	}
}

func (s *panickyProgressSource) BindProgress(ctx context.Context, b consumer.ProgressBinding) error {
	s.hook("BindProgress")
	return s.progressSource.BindProgress(ctx, b)
}

func (s *panickyProgressSource) RecordProgress(ctx context.Context, tx pgx.Tx, ds []consumer.Delivery) error {
	s.hook("RecordProgress")
	return s.progressSource.RecordProgress(ctx, tx, ds)
}

func (s *panickyProgressSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	dv, err := s.progressSource.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return firstPositionsDone{dv, s}, nil
}

type firstPositionsDone struct {
	consumer.Delivery
	s *panickyProgressSource
}

func (firstPositionsDone) DeduplicatedByPosition() bool { return true }

func (d firstPositionsDone) FirstPositionDone(context.Context, pgx.Tx, string) (bool, error) {
	d.s.hook("FirstPositionDone")
	return true, nil
}

func (d firstPositionsDone) DeadLetter(ctx context.Context, dl *consumer.DeadLetter) error {
	d.s.hook("DeadLetter")
	return d.Delivery.DeadLetter(ctx, dl)
}

// A panic in a custom Source's progress hooks (ProgressRecorder,
// FirstPositionChecker) is that call's failure, as its error would be:
// BindProgress's stops Run (wrapping ErrSourceBroken); RecordProgress's
// and FirstPositionDone's roll the transaction back and are retried as
// infrastructure failures, nothing acked before its commit. Each crashed
// the process.
func TestSourceProgressHookPanicIsThatCallsFailure(t *testing.T) {
	setup := panickySourceSetup
	t.Run("BindProgress", func(t *testing.T) {
		pool, b, src := setup(t, "BindProgress", 1)
		b.Publish(consumer.Message{Value: []byte(`{"n":0}`)})
		c, err := consumer.New(pool, src, insertEffect, fastConfig("panicky-bind"))
		require.NoError(t, err)
		err = c.Run(deadline(t, 30*time.Second))
		require.ErrorIs(t, err, consumer.ErrSourceBroken)
		assert.Contains(t, err.Error(), "BindProgress panicked")
		assert.Zero(t, b.Acked())
	})
	t.Run("RecordProgress", func(t *testing.T) {
		pool, b, src := setup(t, "RecordProgress", 2)
		for i := range 3 {
			b.Publish(consumer.Message{Value: []byte(fmt.Sprintf(`{"n":%d}`, i))})
		}
		c, err := consumer.New(pool, src, insertEffect, fastConfig("panicky-record"))
		require.NoError(t, err)
		stop := start(t, c)
		require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 3))
		require.NoError(t, stop())
		assert.Equal(t, map[string]int{"mem/0": 1, "mem/1": 1, "mem/2": 1}, countEffects(t, pool))
		assert.Equal(t, []int64{0, 1, 2}, progressed(t, context.Background(), pool))
		assert.GreaterOrEqual(t, c.Stats().InfraErrors, uint64(2))
	})
	t.Run("RecordProgress after a handler's COMMIT", func(t *testing.T) {
		// The first call records the messages before the handler that
		// committed the batch's transaction itself, in a transaction of
		// its own.
		pool, b, src := setup(t, "RecordProgress", 1)
		for i := range 6 {
			b.Publish(consumer.Message{Value: []byte(fmt.Sprintf(`{"n":%d}`, i))})
		}
		h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
			if err := insertEffect(ctx, tx, ev); err != nil || ev.Payload.N != 2 {
				return err
			}
			_, err := tx.Exec(ctx, "COMMIT")
			return err
		}
		cfg := fastConfig("panicky-record-ended")
		cfg.Batch.Linger = time.Second // one batch of all six
		c, err := consumer.New(pool, src, h, cfg)
		require.NoError(t, err)
		stop := start(t, c)
		require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 6))
		require.NoError(t, stop())
		got := countEffects(t, pool)
		delete(got, "mem/2") // its own COMMIT made its writes durable
		assert.Equal(t, map[string]int{"mem/0": 1, "mem/1": 1, "mem/3": 1, "mem/4": 1, "mem/5": 1}, got)
		assert.Equal(t, []int64{0, 1, 3, 4, 5}, progressed(t, context.Background(), pool))
		assert.Len(t, b.DeadLetters(), 1)
		assert.Negative(t, src.left.Load(), "the panic was met")
	})
	t.Run("FirstPositionDone", func(t *testing.T) {
		pool, b, src := setup(t, "FirstPositionDone", 2)
		// Another consumer's dead letter of a record without an id,
		// redriven: identified by its first position, which is done.
		b.Publish(consumer.Message{Value: []byte(`{"n":0}`), Headers: map[string]string{
			consumer.HeaderRedriveConsumer: "other", consumer.HeaderRedriveEventID: "orders/0/7",
			consumer.HeaderRedriveFallbackID: "orders/0/7"}})
		c, err := consumer.New(pool, src, insertEffect, fastConfig("panicky-first"))
		require.NoError(t, err)
		stop := start(t, c)
		require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 1))
		require.NoError(t, stop())
		assert.Empty(t, countEffects(t, pool), "a duplicate of its first position")
		assert.Equal(t, uint64(1), c.Stats().Duplicates)
		assert.GreaterOrEqual(t, c.Stats().InfraErrors, uint64(2))
	})
}

// closePanicSource closes the source it wraps, then panics.
type closePanicSource struct {
	consumer.Source
	closed atomic.Int32
}

func (s *closePanicSource) Close() error {
	s.closed.Add(1)
	_ = s.Source.Close()
	panic("close bug")
}

// A panic in a custom Source's Close is Close's error: Run returns it
// (wrapping ErrSourceBroken) after its shutdown, the messages it handled
// acked; when Run stops before it started, Close's error is dropped as
// ever. It crashed the process.
func TestSourceClosePanicIsCloseError(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e1", 1)
	src := &closePanicSource{Source: b.Source()}
	c, err := consumer.New(pool, src, insertEffect, fastConfig("panicky-close"))
	require.NoError(t, err)
	stop := start(t, c)
	require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 1))
	err = stop()
	require.ErrorIs(t, err, consumer.ErrSourceBroken)
	assert.Contains(t, err.Error(), "Close panicked")
	assert.Equal(t, int32(1), src.closed.Load())
	assert.Equal(t, map[string]int{"e1": 1}, countEffects(t, pool))

	// Stopped during its start: Close is called, and Run returns.
	src = &closePanicSource{Source: b.Source()}
	c, err = consumer.New(pool, src, insertEffect, fastConfig("panicky-close"))
	require.NoError(t, err)
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	assert.NotPanics(t, func() { err = c.Run(cancelled) })
	assert.NoError(t, err)
	assert.Equal(t, int32(1), src.closed.Load())
}

// panickyNamesSource panics in the telemetry name named panics.
type panickyNamesSource struct {
	consumer.Source
	panics string
}

func (s panickyNamesSource) MessagingSystem() string {
	if s.panics == "MessagingSystem" {
		panic("system bug")
	}
	return "custom"
}

func (s panickyNamesSource) ConsumerGroup() string {
	if s.panics == "ConsumerGroup" {
		panic("group bug")
	}
	return "group"
}

func (s panickyNamesSource) BoundsStreams() bool {
	if s.panics == "BoundsStreams" {
		panic("bound bug")
	}
	return false
}

func (s panickyNamesSource) DeliveryLimit() int64 {
	if s.panics == "DeliveryLimit" {
		panic("limit bug")
	}
	return 0
}

// A panic in a custom Source's telemetry names (SystemNamer, GroupNamer),
// in whether it bounds its streams (StreamBounder) or in its broker's
// delivery limit (DeliveryLimiter), which New asks for, makes New return
// an error wrapping ErrSourceBroken.
// It crashed the caller of New.
func TestSourceNamePanicFailsNew(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{})
	for _, method := range []string{"MessagingSystem", "ConsumerGroup", "BoundsStreams", "DeliveryLimit"} {
		t.Run(method, func(t *testing.T) {
			var err error
			require.NotPanics(t, func() {
				_, err = consumer.New(pool, panickyNamesSource{b.Source(), method}, insertEffect, fastConfig("panicky-names"))
			})
			require.ErrorIs(t, err, consumer.ErrSourceBroken)
			assert.Contains(t, err.Error(), method+" panicked")
		})
	}
	_, err := consumer.New(pool, panickyNamesSource{b.Source(), ""}, insertEffect, fastConfig("panicky-names"))
	assert.NoError(t, err, "names that do not panic")
}

// valueContext is a context of a type that cannot be compared (==): a
// struct holding a map, as a value.
type valueContext struct {
	context.Context
	values map[string]string
}

type valueContextSource struct{ consumer.Source }

type valueContextDelivery struct{ consumer.Delivery }

func (d valueContextDelivery) Context() context.Context {
	return valueContext{d.Delivery.Context(), map[string]string{}}
}

func (s valueContextSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	dv, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return valueContextDelivery{dv}, nil
}

// A delivery whose context cannot be compared (the consumer tells a
// stream's assignments apart by comparing their contexts) stops Run with
// an error wrapping ErrSourceBroken, and loses nothing. It crashed the
// process on a worker's goroutine, comparing two of them.
func TestUncomparableDeliveryContextStopsTheConsumer(t *testing.T) {
	for _, streams := range []int{1, 0} {
		t.Run(fmt.Sprintf("streams=%d", streams), func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: streams})
			want := map[string]int{}
			for i := range 10 {
				id := fmt.Sprintf("e%d", i)
				publish(b, id, i)
				want[id] = 1
			}
			cfg := fastConfig("value-context")
			cfg.Batch.Linger = time.Second // one batch of all ten
			c, err := consumer.New(pool, valueContextSource{b.Source()}, insertEffect, cfg)
			require.NoError(t, err)
			err = c.Run(deadline(t, 30*time.Second))
			require.ErrorIs(t, err, consumer.ErrSourceBroken)
			assert.Contains(t, err.Error(), "cannot be compared")
			c, err = consumer.New(pool, b.Source(), insertEffect, fastConfig("value-context"))
			require.NoError(t, err)
			stop := start(t, c)
			require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 10))
			require.NoError(t, stop())
			assert.Equal(t, want, countEffects(t, pool))
		})
	}
}

// panickySourceSetup returns a schema with the effects and progress
// tables, a broker of one stream, and a panickyProgressSource on it whose
// hook named panics panics at its first left calls.
func panickySourceSetup(t *testing.T, panics string, left int32) (*pgxpool.Pool, *memsource.Broker, *panickyProgressSource) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	_, err := pool.Exec(context.Background(), `CREATE TABLE progress (off bigint NOT NULL)`)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{Streams: 1, FallbackID: true})
	src := &panickyProgressSource{progressSource: &progressSource{Source: b.Source()}, panics: panics}
	src.left.Store(left)
	return pool, b, src
}

// A custom Source whose RecordProgress, FirstPositionDone or DeadLetter
// panics at every call is a bug no retry cures: after
// consumer.SourcePanicLimit panics in a row of the same work, Run returns
// an error wrapping ErrSourceBroken that names the call, and the message
// is left unacked for the broker to deliver again. Each was retried as an
// infrastructure failure for ever, the stream held, a warning at each try.
func TestSourceHookPanickingEveryTimeStopsRun(t *testing.T) {
	for _, method := range []string{"RecordProgress", "FirstPositionDone", "DeadLetter"} {
		t.Run(method, func(t *testing.T) {
			t.Parallel()
			pool, b, src := panickySourceSetup(t, method, 1<<30)
			msg := consumer.Message{Value: []byte(`{"n":0}`)}
			switch method {
			case "FirstPositionDone":
				// A redriven record without an id: identified by its
				// first position, which the source is asked about.
				msg.Headers = map[string]string{consumer.HeaderRedriveConsumer: "other",
					consumer.HeaderRedriveEventID: "orders/0/7", consumer.HeaderRedriveFallbackID: "orders/0/7"}
			case "DeadLetter":
				msg.Value = []byte(`not json`)
			}
			b.Publish(msg)
			c, err := consumer.New(pool, src, insertEffect, fastConfig("panicky-always-"+strings.ToLower(method)))
			require.NoError(t, err)
			err = c.Run(deadline(t, 30*time.Second))
			require.ErrorIs(t, err, consumer.ErrSourceBroken)
			assert.Contains(t, err.Error(), method+" panicked")
			assert.Zero(t, b.Acked(), "nothing is acked")
			assert.Empty(t, b.DeadLetters())
			assert.Empty(t, countEffects(t, pool), "nothing is committed")
			assert.Equal(t, int32(1<<30-consumer.SourcePanicLimit), src.left.Load(), "the call panicked SourcePanicLimit times")
		})
	}
}

// panickyContext is a delivery's context whose method named panics.
type panickyContext struct {
	context.Context
	panics string
}

func (c *panickyContext) Done() <-chan struct{} {
	if c.panics == "Done" {
		panic("a bug in the source's context")
	}
	return c.Context.Done()
}

func (c *panickyContext) Err() error {
	if c.panics == "Err" {
		panic("a bug in the source's context")
	}
	return c.Context.Err()
}

func (c *panickyContext) Value(key any) any {
	if c.panics == "Value" {
		panic("a bug in the source's context")
	}
	return c.Context.Value(key)
}

// panickyContextSource hands out deliveries whose contexts are
// panickyContexts, one for each context of its source's.
type panickyContextSource struct {
	consumer.Source
	panics string
	mu     sync.Mutex
	ctxs   map[context.Context]*panickyContext
}

type ctxMethodPanicDelivery struct {
	consumer.Delivery
	ctx *panickyContext
}

func (d ctxMethodPanicDelivery) Context() context.Context { return d.ctx }

func (s *panickyContextSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	dv, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.ctxs[dv.Context()]
	if c == nil {
		c = &panickyContext{Context: dv.Context(), panics: s.panics}
		s.ctxs[dv.Context()] = c
	}
	return ctxMethodPanicDelivery{dv, c}, nil
}

// A delivery whose context's Done, Err or Value panics stops Run with an
// error wrapping ErrSourceBroken that names the method, and loses
// nothing: the consumer calls them on its workers' goroutines
// (context.AfterFunc, a lane's wait for its assignment's end), where the
// panic crashed the process.
func TestPanickingDeliveryContextStopsTheConsumer(t *testing.T) {
	for _, method := range []string{"Done", "Err", "Value"} {
		t.Run(method, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			want := map[string]int{}
			for i := range 5 {
				id := fmt.Sprintf("e%d", i)
				publish(b, id, i)
				want[id] = 1
			}
			src := &panickyContextSource{Source: b.Source(), panics: method, ctxs: map[context.Context]*panickyContext{}}
			c, err := consumer.New(pool, src, insertEffect, fastConfig("panicky-context"))
			require.NoError(t, err)
			err = c.Run(deadline(t, 30*time.Second))
			require.ErrorIs(t, err, consumer.ErrSourceBroken)
			assert.Contains(t, err.Error(), "Context()."+method+" panicked")
			assert.Zero(t, b.Acked())
			c, err = consumer.New(pool, b.Source(), insertEffect, fastConfig("panicky-context"))
			require.NoError(t, err)
			stop := start(t, c)
			require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 5))
			require.NoError(t, stop())
			assert.Equal(t, want, countEffects(t, pool))
		})
	}
}
