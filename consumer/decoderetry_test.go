package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
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

// errRegistryDown is what a Decoder backed by a schema registry meets
// while the registry is down: a failure of the moment, not of the bytes.
var errRegistryDown = errors.New("schema registry unavailable")

// flakyDecoder is a Decoder backed by a registry that is down for the
// messages whose n is in down, for their first failures decodings each
// (-1: for ever): it asks for a later try with RetryAfter, or, with plain
// set, fails with a plain error. It counts its calls per n.
type flakyDecoder struct {
	down     map[int]bool
	failures int32
	delay    time.Duration
	plain    bool
	mu       sync.Mutex
	calls    map[int]int32
}

func (d *flakyDecoder) decode(data []byte, v any) error {
	var o order
	if err := json.Unmarshal(data, &o); err != nil {
		return err
	}
	d.mu.Lock()
	if d.calls == nil {
		d.calls = map[int]int32{}
	}
	d.calls[o.N]++
	n := d.calls[o.N]
	d.mu.Unlock()
	if d.down[o.N] && (d.failures < 0 || n <= d.failures) {
		if d.plain {
			return errRegistryDown
		}
		return consumer.RetryAfter(d.delay, errRegistryDown)
	}
	return consumer.JSON(data, v)
}

func (d *flakyDecoder) callsOf(n int) int32 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.calls[n]
}

// retryLog records, as Hooks.OnRetry, the waits of one reason.
type retryLog struct {
	mu    sync.Mutex
	waits []consumer.Retry
}

func (l *retryLog) hook(_ context.Context, r consumer.Retry) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.waits = append(l.waits, r)
}

func (l *retryLog) of(reason consumer.RetryReason) []consumer.Retry {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []consumer.Retry
	for _, r := range l.waits {
		if r.Reason == reason {
			out = append(out, r)
		}
	}
	return out
}

// A Decoder backed by a service (a schema registry) that is down for a
// moment says so with RetryAfter, as a handler would: the message is
// decoded again after the delay, in its place in the stream (the message
// before it commits first, the one after it waits), and handled once the
// registry answers. Any Decoder error was dead-lettered at once: every
// message of a registry's outage ended in the dead-letter queue, against
// the decoder's own word that the failure would pass.
func TestDecoderRetryAfterIsRetriedInItsPlace(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for _, id := range []string{"before", "late", "after"} {
		publishRaw(b, id, mustJSON(t, order{N: map[string]int{"before": 1, "late": 2, "after": 3}[id]}))
	}
	dec := &flakyDecoder{down: map[int]bool{2: true}, failures: 2, delay: time.Millisecond}
	var commits commitLog
	var retries retryLog
	cfg := fastConfig("decoder-retry-after")
	cfg.Decoder = dec.decode
	cfg.Batch = consumer.BatchConfig{Size: 3, Linger: 5 * time.Second}
	cfg.Hooks.AfterCommit = commits.hook
	cfg.Hooks.OnRetry = retries.hook
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, 3))

	assert.Empty(t, b.DeadLetters(), "the decoder asked for a later try")
	assert.Equal(t, int32(3), dec.callsOf(2), "two failures, then decoded")
	assert.Equal(t, []string{"before", "late", "after"}, slices.Concat(commits.transactions()...), "each message committed once, in stream order")
	requireEffectsOnce(t, pool, 3)
	waits := retries.of(consumer.RetryDecode)
	require.Len(t, waits, 2)
	for _, w := range waits {
		assert.Equal(t, "late", w.EventID)
		assert.Equal(t, time.Millisecond, w.Wait, "the delay the decoder asked for")
		assert.ErrorIs(t, w.Err, errRegistryDown)
	}
	assert.Equal(t, uint64(3), c.Stats().Handled)
}

// Retrying a decoder is bounded by Retry.MaxAttempts, like a handler's
// RetryAfter: a registry that stays down ends in the dead-letter queue
// with kind decode after MaxAttempts decodings, and the stream goes on. A
// plain Decoder error is still dead-lettered at once, as documented.
func TestDecoderRetryAfterIsDeadLetteredAfterMaxAttempts(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publishRaw(b, "down", mustJSON(t, order{N: 1}))
	publishRaw(b, "next", mustJSON(t, order{N: 2}))
	dec := &flakyDecoder{down: map[int]bool{1: true}, failures: -1, delay: time.Millisecond}
	cfg := fastConfig("decoder-retry-after-spent")
	cfg.Decoder = dec.decode
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, 2))

	assert.Equal(t, int32(cfg.Retry.MaxAttempts), dec.callsOf(1), "decoded Retry.MaxAttempts times")
	dls := b.DeadLetters()
	require.Len(t, dls, 1)
	assert.Equal(t, "down", dls[0].Headers["id"])
	assert.Equal(t, string(consumer.KindDecode), dls[0].Headers[consumer.HeaderErrorKind])
	assert.Equal(t, "0", dls[0].Headers[consumer.HeaderAttempts], "the handler never ran")
	assert.Contains(t, dls[0].Headers[consumer.HeaderErrorMessage], errRegistryDown.Error())
	requireEffectsOnce(t, pool, 1)

	// A plain error is the bytes' own: dead-lettered at once.
	pool2, _ := pgtest.Schema(t)
	effects(t, pool2)
	b2 := memsource.New(memsource.Options{Streams: 1})
	publishRaw(b2, "bad", mustJSON(t, order{N: 1}))
	plain := &flakyDecoder{down: map[int]bool{1: true}, failures: -1, plain: true}
	cfg2 := fastConfig("decoder-plain-error")
	cfg2.Decoder = plain.decode
	c2, err := consumer.New(pool2, b2.Source(), insertEffect, cfg2)
	require.NoError(t, err)
	start(t, c2)
	require.NoError(t, b2.WaitAcked(ctx, 1))
	assert.Equal(t, int32(1), plain.callsOf(1), "a plain decoder error is not retried")
	require.Len(t, b2.DeadLetters(), 1)
	assert.Equal(t, string(consumer.KindDecode), b2.DeadLetters()[0].Headers[consumer.HeaderErrorKind])
}

// flakyEnvelope opens CloudEvents' structured JSON, but fails with
// RetryAfter for its first failures calls (an envelope whose schema is
// looked up in a registry).
type flakyEnvelope struct {
	failures int32
	calls    atomic.Int32
}

func (e *flakyEnvelope) Open(value []byte) (consumer.Opened, error) {
	if e.calls.Add(1) <= e.failures {
		return consumer.Opened{}, consumer.RetryAfter(time.Millisecond, errRegistryDown)
	}
	return consumer.JSONEnvelope{}.Open(value)
}

// An Envelope's RetryAfter is retried as a Decoder's is, also through a
// Router, which picks the handler by the type the envelope names: the
// message is handled under the id the envelope holds, and the crash
// guard, which marks the first messages of an assignment by id, leaves no
// record behind under the id the message had before its envelope opened.
func TestEnvelopeRetryAfterIsRetried(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1})
	b.Publish(consumer.Message{Key: []byte("k"),
		Value: []byte(`{"specversion":"1.0","id":"env-1","type":"order.paid","source":"test","data":{"n":7}}`)})
	env := &flakyEnvelope{failures: 2}
	r := consumer.NewRouter[any](consumer.RouterConfig{})
	var handled atomic.Int32
	require.NoError(t, consumer.Handle(r, "order.paid", func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "env-1" && ev.Payload.N == 7 {
			handled.Add(1)
		}
		return nil
	}))
	cfg := fastConfig("envelope-retry-after")
	cfg.Envelope = env
	c, err := consumer.NewRouted(pool, b.Source(), r, cfg)
	require.NoError(t, err)
	start(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, 1))

	assert.Empty(t, b.DeadLetters(), "the envelope asked for a later try")
	assert.Equal(t, int32(3), env.calls.Load())
	assert.Equal(t, int32(1), handled.Load())
	var processed, records int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE consumer = $1 AND event_id = 'env-1'`,
		cfg.Name).Scan(&processed))
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_events_attempts WHERE consumer = $1`,
		cfg.Name).Scan(&records))
	assert.Equal(t, 1, processed)
	assert.Zero(t, records, "no crash-guard record left behind")
}

// Unordered messages (RabbitMQ's) and a BatchHandler: the message whose
// decoder asked for a later try is handled, alone, once it decodes, and
// the others of its batch, with no order to keep, do not wait for its
// retries: they commit first, together.
func TestDecoderRetryAfterInAnUnorderedBatch(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{})
	for i := 1; i <= 4; i++ {
		publishRaw(b, "u"+string(rune('0'+i)), mustJSON(t, order{N: i}))
	}
	dec := &flakyDecoder{down: map[int]bool{2: true}, failures: 1, delay: time.Millisecond}
	var mu sync.Mutex
	seen := map[string]int{}
	h := func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
		mu.Lock()
		defer mu.Unlock()
		for _, ev := range evs {
			seen[ev.ID]++
		}
		return nil
	}
	var commits commitLog
	cfg := fastConfig("decoder-retry-after-unordered")
	cfg.Decoder = dec.decode
	// The four wait before Run: one batch, closed when full.
	cfg.Batch = consumer.BatchConfig{Size: 4, Linger: time.Minute}
	cfg.Hooks.AfterCommit = commits.hook
	c, err := consumer.NewBatch(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, 4))

	assert.Empty(t, b.DeadLetters())
	assert.Equal(t, int32(2), dec.callsOf(2))
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, map[string]int{"u1": 1, "u2": 1, "u3": 1, "u4": 1}, seen, "each handled once")
	assert.Equal(t, [][]string{{"u1", "u3", "u4"}, {"u2"}}, commits.transactions())
	assert.Equal(t, uint64(4), c.Stats().Handled)
}

// A message waiting for its decoder's retry is abandoned at the
// shutdown, unacked and not dead-lettered, as a handler's is: the wait
// (here an hour) does not hold Run, and the broker delivers the message
// again to the next process.
func TestDecoderRetryAfterWaitEndsAtShutdown(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publishRaw(b, "waiting", mustJSON(t, order{N: 1}))
	dec := &flakyDecoder{down: map[int]bool{1: true}, failures: -1, delay: time.Hour}
	waiting := make(chan struct{})
	var once sync.Once
	cfg := fastConfig("decoder-retry-after-shutdown")
	cfg.Decoder = dec.decode
	cfg.Hooks.OnRetry = func(_ context.Context, r consumer.Retry) {
		if r.Reason == consumer.RetryDecode {
			once.Do(func() { close(waiting) })
		}
	}
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	select {
	case <-waiting:
	case <-time.After(60 * time.Second):
		t.Fatal("the decoder's failure was never retried")
	}
	require.NoError(t, stop())
	assert.False(t, b.IsAcked(0), "abandoned for redelivery")
	assert.Empty(t, b.DeadLetters())
	assert.Equal(t, int32(1), dec.callsOf(1))
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	data, err := json.Marshal(v)
	require.NoError(t, err)
	return data
}

// A message decoded again goes through the crash guard once it decodes,
// as it would have had it decoded at once: here a redelivery that an
// earlier process crashed on CrashGuard.MaxCrashes times is dead-lettered
// as a crash loop, its handler not run again.
func TestMessageDecodedAgainGoesThroughTheCrashGuard(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	migratedStore(t, pool)
	cfg := fastConfig("decoder-retry-after-crash-guard")
	cfg.CrashGuard.MaxCrashes = 2
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, err := pool.Exec(ctx, `INSERT INTO processed_events_attempts (consumer, event_id, attempts, crashes) VALUES ($1, 'looping', 2, 2)`, cfg.Name)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{Streams: 1})
	b.Publish(consumer.Message{Value: mustJSON(t, order{N: 1}), Headers: map[string]string{"id": "looping"}, Key: []byte("k"), Redelivered: true})
	dec := &flakyDecoder{down: map[int]bool{1: true}, failures: 1, delay: time.Millisecond}
	cfg.Decoder = dec.decode
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	require.NoError(t, b.WaitAcked(ctx, 1))

	assert.Equal(t, int32(2), dec.callsOf(1), "decoded at the second try")
	dls := b.DeadLetters()
	require.Len(t, dls, 1)
	assert.Equal(t, string(consumer.KindCrashLoop), dls[0].Headers[consumer.HeaderErrorKind])
	assert.Empty(t, countEffects(t, pool), "the handler did not run")
}

// A Decoder's RetryAfter around an error whose Error method panics is the
// decoder's panic, dead-lettered with kind panic as such an error always
// was: the consumer reads the error while the decoder's panics are still
// caught, not later, when it writes the dead letter, where a panic would
// end the process.
func TestDecoderRetryAfterAroundAnUnreadableErrorIsAPanic(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publishRaw(b, "broken", mustJSON(t, order{N: 1}))
	publishRaw(b, "fine", mustJSON(t, order{N: 2}))
	cfg := fastConfig("decoder-retry-after-unreadable")
	cfg.Decoder = func(data []byte, v any) error {
		if string(data) == `{"n":1}` {
			return consumer.RetryAfter(time.Millisecond, &brokenError{})
		}
		return consumer.JSON(data, v)
	}
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, 2))
	dls := b.DeadLetters()
	require.Len(t, dls, 1)
	assert.Equal(t, "broken", dls[0].Headers["id"])
	assert.Equal(t, string(consumer.KindPanic), dls[0].Headers[consumer.HeaderErrorKind])
	requireEffectsOnce(t, pool, 1)
}
