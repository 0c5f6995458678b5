package conformance

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceco/once/consumer"
)

// waitFor bounds every wait of the suite; brokers with a consumer-group
// join take seconds to start delivering.
const waitFor = 60 * time.Second

// Run runs the suite. Each test gets its own Broker and database schema,
// and runs in parallel with the others.
func Run(t *testing.T, s Suite) {
	tests := []struct {
		name string
		run  func(t *testing.T, e *env)
		skip bool
	}{
		{"EachEffectOnce", testEachEffectOnce, false},
		{"AckedNotRedelivered", testAckedNotRedelivered, false},
		{"MetadataReachesHandler", testMetadata, false},
		{"TraceContextFromHeaders", testTraceContext, false},
		{"DecodeErrorDeadLettered", testDecodeError, false},
		{"HandlerFailureDeadLettered", testHandlerFailure, false},
		{"PanicDeadLettered", testPanic, false},
		{"MissingID", testMissingID, false},
		{"FallbackIDStableAcrossRedelivery", testFallbackIDStable, !s.Features.FallbackID || !s.Features.RedeliverOnRestart},
		{"OrderPerStream", testOrder, !s.Features.Ordered},
		{"RedeliveryAfterCrashBeforeAck", testCrashBeforeAck, !s.Features.RedeliverOnRestart},
		{"ShutdownMidFlight", testShutdownMidFlight, !s.Features.RedeliverOnRestart},
		{"InFlightNotAckedByOthers", testInFlightNotAckedByOthers, !s.Features.RedeliverOnRestart || s.Features.Ordered},
		{"StallLoopDeadLettered", testStallLoop, !s.Features.RedeliverOnRestart},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.skip {
				t.Skip("the adapter does not declare the feature this test needs")
			}
			t.Parallel()
			db := s.NewDB(t)
			_, err := db.Exec(context.Background(),
				`CREATE TABLE effects (event_id text NOT NULL, k text NOT NULL DEFAULT '', n int NOT NULL DEFAULT 0, seq bigserial)`)
			require.NoError(t, err)
			tc.run(t, &env{t: t, f: s.Features, b: s.NewBroker(t), db: db, tune: s.Tune})
		})
	}
}

// env is one test's broker and database.
type env struct {
	t  *testing.T
	f  Features
	b  Broker
	db *pgxpool.Pool
	// tune adjusts every consumer configuration.
	tune func(*consumer.Config)
}

// payload is what the suite publishes.
type payload struct {
	K string `json:"k"`
	N int    `json:"n"`
}

func msg(id, key string, n int) OutMessage {
	v, _ := json.Marshal(payload{K: key, N: n})
	return OutMessage{ID: id, Key: []byte(key), Value: v}
}

func (e *env) publish(msgs ...OutMessage) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	require.NoError(e.t, e.b.Publish(ctx, msgs...))
}

// record writes one business effect in the handler's transaction.
func record(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, k, n) VALUES ($1, $2, $3)`, ev.ID, ev.Payload.K, ev.Payload.N)
	return err
}

func config() consumer.Config {
	return consumer.Config{
		Name:            "conformance",
		Retry:           consumer.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond},
		InfraBackoff:    consumer.Backoff{Initial: 10 * time.Millisecond, Max: 200 * time.Millisecond},
		ShutdownTimeout: 20 * time.Second,
	}
}

// running is a consumer running in the background.
type running struct {
	c    *consumer.Consumer[payload]
	stop func() error
}

func (e *env) start(src consumer.Source, cfg consumer.Config, h consumer.Handler[payload]) *running {
	e.t.Helper()
	if e.tune != nil {
		e.tune(&cfg)
	}
	c, err := consumer.New(e.db, src, h, cfg)
	require.NoError(e.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	var runErr error
	stop := func() error {
		once.Do(func() { cancel(); runErr = <-done })
		return runErr
	}
	e.t.Cleanup(func() { _ = stop() })
	return &running{c: c, stop: stop}
}

// effects returns the number of effects per event id.
func (e *env) effects() map[string]int {
	e.t.Helper()
	rows, err := e.db.Query(context.Background(), `SELECT event_id, count(*) FROM effects GROUP BY event_id`)
	require.NoError(e.t, err)
	got := map[string]int{}
	var id string
	var n int
	_, err = pgx.ForEachRow(rows, []any{&id, &n}, func() error { got[id] = n; return nil })
	require.NoError(e.t, err)
	return got
}

func (e *env) waitEffects(n int) {
	e.t.Helper()
	require.Eventually(e.t, func() bool { return len(e.effects()) >= n }, waitFor, 20*time.Millisecond,
		"want effects of %d events", n)
}

func (e *env) waitSettled(r *running, n uint64) {
	e.t.Helper()
	require.Eventually(e.t, func() bool {
		st := r.c.Stats()
		return st.Handled+st.Duplicates+st.DeadLettered+st.Skipped >= n
	}, waitFor, 20*time.Millisecond, "want %d messages settled", n)
}

func (e *env) assertExactlyOnce(ids ...string) {
	e.t.Helper()
	got := e.effects()
	want := map[string]int{}
	for _, id := range ids {
		want[id] = 1
	}
	assert.Equal(e.t, want, got, "each event's effect exactly once, nothing lost")
}

func (e *env) deadLetters(n int) []DeadLetterRecord {
	e.t.Helper()
	var got []DeadLetterRecord
	require.Eventually(e.t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var err error
		got, err = e.b.DeadLetters(ctx)
		return err == nil && len(got) >= n
	}, waitFor, 50*time.Millisecond, "want %d dead letters", n)
	return got
}

func ids(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%d", prefix, i)
	}
	return out
}

func testEachEffectOnce(t *testing.T, e *env) {
	all := ids("ev", 40)
	var msgs []OutMessage
	for i, id := range all {
		msgs = append(msgs, msg(id, "k"+strconv.Itoa(i%4), i))
	}
	// Copies of every fourth event, later in the stream, as a producer
	// retry would publish them.
	for i := 0; i < len(all); i += 4 {
		msgs = append(msgs, msg(all[i], "k0", i))
	}
	e.publish(msgs...)
	r := e.start(e.b.NewSource(t), config(), record)
	e.waitSettled(r, uint64(len(msgs)))
	e.assertExactlyOnce(all...)
	st := r.c.Stats()
	assert.Equal(t, uint64(len(all)), st.Handled)
	assert.Equal(t, uint64(len(msgs)-len(all)), st.Duplicates)
	assert.Zero(t, st.DeadLettered)
}

func testAckedNotRedelivered(t *testing.T, e *env) {
	const keys = 3
	all := ids("acked", 20)
	var msgs []OutMessage
	for i, id := range all {
		msgs = append(msgs, msg(id, "k"+strconv.Itoa(i%keys), i))
	}
	e.publish(msgs...)
	r := e.start(e.b.NewSource(t), config(), record)
	e.waitSettled(r, uint64(len(msgs)))
	require.NoError(t, r.stop())

	// A restarted consumer must start after the acked messages: it sees
	// only what is published now, one message per key. A message given
	// again comes before what was published after it on its stream (a
	// partition, a queue): once the restarted consumer has handled the
	// new messages of every key, it has received whatever it was given
	// again, and no time has to pass to be sure of it.
	after := ids("after-restart", keys)
	var next []OutMessage
	for k, id := range after {
		next = append(next, msg(id, "k"+strconv.Itoa(k), k))
	}
	e.publish(next...)
	r2 := e.start(e.b.NewSource(t), config(), record)
	e.waitEffects(len(all) + len(after))
	e.waitSettled(r2, uint64(len(after)))
	e.assertExactlyOnce(append(all, after...)...)
	st := r2.c.Stats()
	assert.Equal(t, uint64(len(after)), st.Received, "acked messages were delivered again after a clean stop")
	assert.Zero(t, st.Duplicates, "acked messages were delivered again after a clean stop")
}

func testMetadata(t *testing.T, e *env) {
	m := msg("meta-1", "the-key", 7)
	m.Type = "thing.happened"
	m.Headers = map[string]string{"x-custom": "custom value"}
	e.publish(m)
	got := make(chan consumer.Event[payload], 1)
	e.start(e.b.NewSource(t), config(), func(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
		select {
		case got <- ev:
		default:
		}
		return record(ctx, tx, ev)
	})
	var ev consumer.Event[payload]
	select {
	case ev = <-got:
	case <-time.After(waitFor):
		t.Fatal("no event handled")
	}
	assert.Equal(t, "meta-1", ev.ID)
	assert.Equal(t, "thing.happened", ev.Type)
	assert.Equal(t, payload{K: "the-key", N: 7}, ev.Payload)
	assert.Equal(t, 1, ev.Attempt)
	assert.Equal(t, "custom value", ev.Message.Headers["x-custom"])
	assert.NotEmpty(t, ev.Message.Topic)
	if e.f.Ordered {
		assert.Equal(t, []byte("the-key"), ev.Message.Key)
		assert.NotEmpty(t, ev.Message.Stream)
	}
}

func testTraceContext(t *testing.T, e *env) {
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	m := msg("traced-1", "k", 1)
	m.Headers = map[string]string{"traceparent": "00-" + traceID + "-00f067aa0ba902b7-01"}
	e.publish(m)
	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	cfg := config()
	cfg.Telemetry.TracerProvider = tp
	got := make(chan trace.SpanContext, 1)
	e.start(e.b.NewSource(t), cfg, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
		select {
		case got <- trace.SpanContextFromContext(ctx):
		default:
		}
		return record(ctx, tx, ev)
	})
	select {
	case sc := <-got:
		assert.Equal(t, traceID, sc.TraceID().String(), "the consumer span must continue the producer's trace")
	case <-time.After(waitFor):
		t.Fatal("no event handled")
	}
}

func testDecodeError(t *testing.T, e *env) {
	garbage := []byte("\x00not json at all\xff")
	e.publish(OutMessage{ID: "garbage-1", Key: []byte("k"), Value: garbage}, msg("good-1", "k", 1))
	r := e.start(e.b.NewSource(t), config(), record)
	e.waitSettled(r, 2)
	e.assertExactlyOnce("good-1")
	dl := e.deadLetters(1)
	require.Len(t, dl, 1)
	assert.Equal(t, garbage, dl[0].Value, "the dead letter keeps the original bytes")
	assert.Equal(t, string(consumer.KindDecode), dl[0].Headers[consumer.HeaderErrorKind])
	assert.Equal(t, "garbage-1", dl[0].Headers[consumer.HeaderEventID])
	assert.Equal(t, "conformance", dl[0].Headers[consumer.HeaderConsumer])
	assert.NotEmpty(t, dl[0].Headers[consumer.HeaderErrorMessage])
	assert.NotEmpty(t, dl[0].Headers[consumer.HeaderFailedAt])
	assert.NotEmpty(t, dl[0].Headers[consumer.HeaderOriginalTopic])
}

func testHandlerFailure(t *testing.T, e *env) {
	bad := msg("bad-1", "k", 1)
	bad.Headers = map[string]string{"x-custom": "kept"}
	e.publish(bad, msg("good-1", "k", 2))
	var badCalls atomic.Int32
	var badKey atomic.Value // the key the handler saw
	r := e.start(e.b.NewSource(t), config(), func(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
		if err := record(ctx, tx, ev); err != nil {
			return err
		}
		if ev.ID == "bad-1" {
			badCalls.Add(1)
			badKey.Store(string(ev.Message.Key))
			return errors.New("business rule violated")
		}
		return nil
	})
	e.waitSettled(r, 2)
	e.assertExactlyOnce("good-1")
	assert.Equal(t, int32(2), badCalls.Load(), "MaxAttempts is 2")
	dl := e.deadLetters(1)
	require.Len(t, dl, 1)
	assert.Equal(t, string(consumer.KindHandler), dl[0].Headers[consumer.HeaderErrorKind])
	assert.Equal(t, "2", dl[0].Headers[consumer.HeaderAttempts])
	assert.Contains(t, dl[0].Headers[consumer.HeaderErrorMessage], "business rule violated")
	// A copy of the message: its key and original headers as well as its
	// value.
	assert.Equal(t, "kept", dl[0].Headers["x-custom"], "the dead letter keeps the original headers")
	assert.Equal(t, badKey.Load(), string(dl[0].Key), "the dead letter keeps the original key")
	var p payload
	require.NoError(t, json.Unmarshal(dl[0].Value, &p))
	assert.Equal(t, payload{K: "k", N: 1}, p)
}

func testPanic(t *testing.T, e *env) {
	e.publish(msg("panics-1", "k", 1), msg("good-1", "k", 2))
	r := e.start(e.b.NewSource(t), config(), func(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
		if ev.ID == "panics-1" {
			panic("boom")
		}
		return record(ctx, tx, ev)
	})
	e.waitSettled(r, 2)
	e.assertExactlyOnce("good-1")
	dl := e.deadLetters(1)
	require.Len(t, dl, 1)
	assert.Equal(t, string(consumer.KindPanic), dl[0].Headers[consumer.HeaderErrorKind])
	assert.Contains(t, dl[0].Headers[consumer.HeaderErrorStack], "panic")
}

// testMissingID: a message without an id is handled under its fallback id
// when the adapter derives one, else dead-lettered KindMissingID. Two
// id-less messages, which must not share a fallback id: one shared by
// different messages (a position without its offset) skips the second
// as a duplicate, lost. FallbackIDStableAcrossRedelivery catches that
// only for adapters that also redeliver on restart.
func testMissingID(t *testing.T, e *env) {
	e.publish(msg("", "k", 1), msg("with-id", "k", 2), msg("", "k", 3))
	r := e.start(e.b.NewSource(t), config(), record)
	e.waitSettled(r, 3)
	got := e.effects()
	if e.f.FallbackID {
		require.Len(t, got, 3, "each id-less message is handled under a fallback id of its own")
		assert.Equal(t, 1, got["with-id"])
		assert.Zero(t, r.c.Stats().Duplicates, "an id-less message was taken for a duplicate of another")
		return
	}
	e.assertExactlyOnce("with-id")
	dl := e.deadLetters(2)
	require.Len(t, dl, 2)
	for _, d := range dl {
		assert.Equal(t, string(consumer.KindMissingID), d.Headers[consumer.HeaderErrorKind])
	}
}

// testFallbackIDStable: id-less messages handled under their fallback ids
// and never acked are redelivered with the same fallback ids, so their
// redeliveries are duplicates. A fallback id that changes between
// deliveries (one derived from a delivery tag or a receive time) would
// handle each again.
func testFallbackIDStable(t *testing.T, e *env) {
	e.publish(msg("", "k0", 1), msg("", "k1", 2))
	r := e.start(&dropAcks{Source: e.b.NewSource(t), after: 0}, config(), record)
	e.waitSettled(r, 2)
	require.NoError(t, r.stop())
	first := e.effects()
	require.Len(t, first, 2, "both id-less messages handled under their fallback ids")

	r2 := e.start(e.b.NewSource(t), config(), record)
	e.waitSettled(r2, 2)
	assert.Equal(t, first, e.effects(), "the redeliveries had the same fallback ids: no effect twice")
	assert.Equal(t, uint64(2), r2.c.Stats().Duplicates, "both redeliveries are duplicates")
	assert.Zero(t, r2.c.Stats().Handled)
}

func testOrder(t *testing.T, e *env) {
	const keys, perKey = 4, 25
	var msgs []OutMessage
	var all []string
	for n := 0; n < perKey; n++ {
		for k := 0; k < keys; k++ {
			id := fmt.Sprintf("k%d-%d", k, n)
			all = append(all, id)
			msgs = append(msgs, msg(id, "k"+strconv.Itoa(k), n))
		}
	}
	e.publish(msgs...)
	cfg := config()
	cfg.Concurrency = 8
	r := e.start(e.b.NewSource(t), cfg, record)
	e.waitSettled(r, uint64(len(msgs)))
	e.assertExactlyOnce(all...)
	rows, err := e.db.Query(context.Background(), `SELECT k, n FROM effects ORDER BY seq`)
	require.NoError(t, err)
	last := map[string]int{}
	var k string
	var n int
	_, err = pgx.ForEachRow(rows, []any{&k, &n}, func() error {
		if prev, ok := last[k]; ok {
			assert.Greater(t, n, prev, "key %s committed out of order", k)
		}
		last[k] = n
		return nil
	})
	require.NoError(t, err)
}

// dropAcks wraps a source so that from the first delivery at or after
// offset `after` (counting deliveries), Ack does nothing: what a process
// killed between commit and ack leaves behind.
type dropAcks struct {
	consumer.Source
	after, seen int
	mu          sync.Mutex
}

type droppedAck struct {
	consumer.Delivery
	drop bool
}

func (d *droppedAck) Ack(ctx context.Context) error {
	if d.drop {
		return nil
	}
	return d.Delivery.Ack(ctx)
}

func (s *dropAcks) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seen++
	return &droppedAck{Delivery: d, drop: s.seen > s.after}, nil
}

func testCrashBeforeAck(t *testing.T, e *env) {
	all := ids("crash", 30)
	var msgs []OutMessage
	for i, id := range all {
		msgs = append(msgs, msg(id, "k"+strconv.Itoa(i%3), i))
	}
	e.publish(msgs...)
	r := e.start(&dropAcks{Source: e.b.NewSource(t), after: 10}, config(), record)
	e.waitSettled(r, uint64(len(msgs)))
	require.NoError(t, r.stop())
	e.assertExactlyOnce(all...)

	r2 := e.start(e.b.NewSource(t), config(), record)
	e.waitSettled(r2, uint64(len(msgs)-10))
	e.assertExactlyOnce(all...)
	assert.GreaterOrEqual(t, r2.c.Stats().Duplicates, uint64(len(msgs)-10),
		"every message whose ack was lost is redelivered and skipped as a duplicate")
	assert.Zero(t, r2.c.Stats().Handled)
}

func testShutdownMidFlight(t *testing.T, e *env) {
	all := ids("inflight", 30)
	var msgs []OutMessage
	for i, id := range all {
		msgs = append(msgs, msg(id, "k"+strconv.Itoa(i%3), i))
	}
	e.publish(msgs...)
	var calls atomic.Int32
	slow := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
		calls.Add(1)
		select {
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
		return record(ctx, tx, ev)
	}
	cfg := config()
	cfg.Concurrency = 2
	r := e.start(e.b.NewSource(t), cfg, slow)
	require.Eventually(t, func() bool { return calls.Load() >= 5 }, waitFor, 5*time.Millisecond)
	require.NoError(t, r.stop())
	first := len(e.effects())
	assert.Less(t, first, len(all), "the consumer stopped before the end")

	r2 := e.start(e.b.NewSource(t), config(), record)
	e.waitEffects(len(all))
	e.waitSettled(r2, uint64(len(all)-first))
	e.assertExactlyOnce(all...)
}

// testInFlightNotAckedByOthers: on an unordered adapter, where messages
// are handled side by side, the ack of one message settles that message
// only. One whose ack also settled those received before it (an AMQP ack
// with multiple set, one offset committed for a whole unordered queue)
// settled a message still in its handler, and lost it when the consumer
// stopped before that handler finished. ShutdownMidFlight misses it: its
// handlers take as long as each other, so none finishes far ahead of an
// earlier one.
func testInFlightNotAckedByOthers(t *testing.T, e *env) {
	others := ids("other", 10)
	msgs := []OutMessage{msg("held-1", "k", 0)}
	for i, id := range others {
		msgs = append(msgs, msg(id, "k", i+1))
	}
	e.publish(msgs...)
	cfg := config()
	cfg.Concurrency = 4
	cfg.ShutdownTimeout = 200 * time.Millisecond
	entered := make(chan struct{}, 1)
	held := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
		if ev.ID == "held-1" {
			select {
			case entered <- struct{}{}:
			default:
			}
			<-ctx.Done() // held until the shutdown deadline cuts it short
			return ctx.Err()
		}
		return record(ctx, tx, ev)
	}
	// One transaction per message: a batch would hold the others in
	// held-1's transaction.
	tune := e.tune
	e.tune = func(c *consumer.Config) {
		if tune != nil {
			tune(c)
		}
		c.Batch.Size = 1
	}
	r := e.start(e.b.NewSource(t), cfg, held)
	e.tune = tune
	select {
	case <-entered:
	case <-time.After(waitFor):
		t.Fatal("held-1 was not handled")
	}
	// Every other message is handled and acked while held-1 is in flight.
	e.waitEffects(len(others))
	e.waitSettled(r, uint64(len(others)))
	require.NoError(t, r.stop())
	require.NotContains(t, e.effects(), "held-1")

	r2 := e.start(e.b.NewSource(t), config(), record)
	require.Eventually(t, func() bool { return e.effects()["held-1"] > 0 }, waitFor, 20*time.Millisecond,
		"held-1 was never delivered again: the ack of another message settled it while it was in flight")
	e.waitSettled(r2, 1)
	e.assertExactlyOnce(append(others, "held-1")...)
}

// testStallLoop: a message whose handler stalls past the shutdown deadline
// on every delivery (as one that crashes the process would die with it) is
// dead-lettered with kind KindCrashLoop after Config.CrashGuard.MaxCrashes
// such runs of its own, instead of stalling every restart. The crash guard
// counts only what the adapter lets it suspect: a redelivery after a new
// Delivery.Context of its stream (an ordered adapter), or one the broker
// marks with Message.Redelivered or DeliveryCount.
func testStallLoop(t *testing.T, e *env) {
	e.publish(msg("stalls-1", "k", 1), msg("good-1", "k", 2))
	cfg := config()
	cfg.CrashGuard.MaxCrashes = 1
	cfg.ShutdownTimeout = 200 * time.Millisecond
	var stalls atomic.Int32
	entered := make(chan struct{}, 8)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
		if ev.ID == "stalls-1" {
			stalls.Add(1)
			entered <- struct{}{}
			<-ctx.Done() // only the shutdown deadline ends it
			return ctx.Err()
		}
		return record(ctx, tx, ev)
	}
	// The first run, and the one that runs it alone as a suspect: each
	// stalls until the shutdown deadline cuts it short.
	for run := 1; run <= 2; run++ {
		r := e.start(e.b.NewSource(t), cfg, h)
		select {
		case <-entered:
		case <-time.After(waitFor):
			t.Fatalf("run %d: the handler was not called", run)
		}
		require.NoError(t, r.stop())
	}
	r := e.start(e.b.NewSource(t), cfg, h)
	require.Eventually(t, func() bool { return r.c.Stats().DeadLettered >= 1 || stalls.Load() > 2 }, waitFor, 20*time.Millisecond,
		"want the message dead-lettered")
	require.Equal(t, int32(2), stalls.Load(), "a message that stalled alone MaxCrashes times ran again: its redelivery was not suspected")
	e.waitEffects(1) // good-1, in this run or an earlier one
	e.assertExactlyOnce("good-1")
	dl := e.deadLetters(1)
	require.Len(t, dl, 1)
	assert.Equal(t, "stalls-1", dl[0].Headers[consumer.HeaderEventID])
	assert.Equal(t, string(consumer.KindCrashLoop), dl[0].Headers[consumer.HeaderErrorKind])
}
