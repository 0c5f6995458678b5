package consumer_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// A hook, a Decoder or an EventID function that hangs holds its stream
// with no bound of its own: once it has run past HandlerTimeout it is
// logged at Error, naming the function and the message, and counted in
// Stats.StuckCalls; the message is handled once it returns.
func TestStuckUserFunctionIsLogged(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	for _, fn := range []string{"OnOutcome", "OnRetry", "AfterCommit", "Decoder", "Identify.EventID"} {
		t.Run(fn, func(t *testing.T) {
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "stuck-"+fn, 1)
			release := make(chan struct{})
			var once sync.Once
			block := func(name string) {
				if name == fn {
					once.Do(func() { <-release })
				}
			}
			log := &levelLog{}
			cfg := fastConfig("stuck-" + strings.ReplaceAll(fn, ".", "-"))
			cfg.Telemetry.Logger = slog.New(log)
			cfg.HandlerTimeout = 100 * time.Millisecond
			cfg.Hooks = consumer.Hooks{
				OnOutcome:   func(context.Context, consumer.Outcome) { block("OnOutcome") },
				OnRetry:     func(context.Context, consumer.Retry) { block("OnRetry") },
				AfterCommit: func(context.Context, []consumer.Committed) { block("AfterCommit") },
			}
			cfg.Decoder = func(data []byte, v any) error {
				block("Decoder")
				return consumer.JSON(data, v)
			}
			cfg.Identify.EventID = func(m *consumer.Message) (string, error) {
				block("Identify.EventID")
				return m.Headers["id"], nil
			}
			failed := false
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				if !failed {
					failed = true
					return errors.New("once more") // one retry, for OnRetry
				}
				return insertEffect(ctx, tx, ev)
			}
			c, err := consumer.New(pool, b.Source(), h, cfg)
			require.NoError(t, err)
			stop := start(t, c)
			unblock := sync.OnceFunc(func() { close(release) })
			defer unblock() // a failed wait must not leave the function blocked
			stuck := func() string {
				for _, l := range log.lines() {
					if strings.HasPrefix(l, "ERROR ") && strings.Contains(l, "function="+fn+" ") {
						return l
					}
				}
				return ""
			}
			require.Eventually(t, func() bool { return stuck() != "" }, 20*time.Second, 5*time.Millisecond,
				"no error-level record of the stuck %s in %q", fn, log.lines())
			if fn != "OnRetry" {
				assert.Contains(t, stuck(), "offset=0")
			}
			if fn != "Identify.EventID" {
				assert.Contains(t, stuck(), "event_id=stuck-"+fn)
			}
			assert.Equal(t, uint64(1), c.Stats().StuckCalls)
			unblock()
			require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, 5*time.Millisecond)
			require.NoError(t, stop())
			assert.Equal(t, uint64(1), c.Stats().StuckCalls, "logged once")
		})
	}
}

// hangingSource is a progressSource whose method named hangs at its first
// call until release is closed, ignoring its context, as a custom Source
// stuck in a client call without a deadline would.
type hangingSource struct {
	*progressSource
	method  string
	release chan struct{}
	once    sync.Once
}

func (s *hangingSource) hang(method string) {
	if method == s.method {
		s.once.Do(func() { <-s.release })
	}
}

func (s *hangingSource) RecordProgress(ctx context.Context, tx pgx.Tx, ds []consumer.Delivery) error {
	s.hang("RecordProgress")
	return s.progressSource.RecordProgress(ctx, tx, ds)
}

func (s *hangingSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	dv, err := s.progressSource.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return hangingDelivery{dv, s}, nil
}

type hangingDelivery struct {
	consumer.Delivery
	s *hangingSource
}

func (d hangingDelivery) Ack(ctx context.Context) error {
	d.s.hang("Ack")
	return d.Delivery.Ack(ctx)
}

func (d hangingDelivery) DeadLetter(ctx context.Context, dl *consumer.DeadLetter) error {
	d.s.hang("DeadLetter")
	return d.Delivery.DeadLetter(ctx, dl)
}

// A custom Source's Ack, DeadLetter or RecordProgress that hangs, its
// context ignored, holds its stream as a stuck hook does: once it has run
// past HandlerTimeout it is logged at Error, naming the call and the
// message, counted in Stats.StuckCalls and in once.consumer.stuck_calls.
// It held the stream without a word.
func TestStuckSourceCallIsLogged(t *testing.T) {
	for _, method := range []string{"Ack", "DeadLetter", "RecordProgress"} {
		t.Run(method, func(t *testing.T) {
			t.Parallel()
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			_, err := pool.Exec(context.Background(), `CREATE TABLE progress (off bigint NOT NULL)`)
			require.NoError(t, err)
			b := memsource.New(memsource.Options{Streams: 1, FallbackID: true})
			value := `{"n":0}`
			if method == "DeadLetter" {
				value = "not json"
			}
			b.Publish(consumer.Message{Value: []byte(value)})
			src := &hangingSource{progressSource: &progressSource{Source: b.Source()}, method: method, release: make(chan struct{})}
			unblock := sync.OnceFunc(func() { close(src.release) })
			defer unblock() // a failed wait must not leave the call blocked
			log := &levelLog{}
			reader := sdkmetric.NewManualReader()
			cfg := fastConfig("stuck-source-" + method)
			cfg.Telemetry.Logger = slog.New(log)
			cfg.Telemetry.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
			cfg.HandlerTimeout = 100 * time.Millisecond
			c, err := consumer.New(pool, src, insertEffect, cfg)
			require.NoError(t, err)
			stop := start(t, c)
			name := map[string]string{"Ack": "Delivery.Ack", "DeadLetter": "Delivery.DeadLetter", "RecordProgress": "Source.RecordProgress"}[method]
			stuck := func() string {
				for _, l := range log.lines() {
					if strings.HasPrefix(l, "ERROR ") && strings.Contains(l, "function="+name+" ") {
						return l
					}
				}
				return ""
			}
			require.Eventually(t, func() bool { return stuck() != "" }, 20*time.Second, 5*time.Millisecond,
				"no error-level record of the stuck %s in %q", name, log.lines())
			if method == "RecordProgress" {
				assert.Contains(t, stuck(), "messages=1")
			} else {
				assert.Contains(t, stuck(), "offset=0")
				assert.Contains(t, stuck(), "event_id=mem/0")
			}
			assert.Equal(t, uint64(1), c.Stats().StuckCalls)
			assert.Equal(t, map[string]int64{name: 1}, sums(t, reader, "once.consumer.stuck_calls", "once.function"))
			unblock()
			require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 1))
			require.NoError(t, stop())
			assert.Equal(t, uint64(1), c.Stats().StuckCalls, "logged once")
		})
	}
}

// A handler that ignores its context's end at HandlerTimeout holds its
// stream and its transaction until it returns: once it has run for twice
// HandlerTimeout it is logged at Error, naming the message, and counted as
// a stuck call; when it returns (its statement on the ended context
// failing), its run has failed and the message is tried again. A handler that returns at its deadline, as it should, is
// never reported. A hung handler held its stream without a word.
func TestHandlerIgnoringItsTimeoutIsLogged(t *testing.T) {
	for _, tc := range []struct {
		name  string
		batch bool
	}{{"handler", false}, {"BatchHandler", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "deaf-"+tc.name, 1)
			release := make(chan struct{})
			unblock := sync.OnceFunc(func() { close(release) })
			defer unblock() // a failed wait must not leave the handler blocked
			log := &levelLog{}
			reader := sdkmetric.NewManualReader()
			cfg := fastConfig("deaf-" + tc.name)
			cfg.Telemetry.Logger = slog.New(log)
			cfg.Telemetry.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
			// The second run's insert must answer within it (exactly two
			// runs are asserted): 100 ms left a loaded machine too little.
			cfg.HandlerTimeout = time.Second
			var runs atomic.Int32
			deaf := func() {
				if runs.Add(1) == 1 {
					<-release // its context ignored
				}
			}
			var c *consumer.Consumer[order]
			var err error
			if tc.batch {
				h := func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
					deaf()
					for _, ev := range evs {
						if err := insertEffect(ctx, tx, ev); err != nil {
							return err
						}
					}
					return nil
				}
				c, err = consumer.NewBatch(pool, b.Source(), h, cfg)
			} else {
				h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
					deaf()
					return insertEffect(ctx, tx, ev)
				}
				c, err = consumer.New(pool, b.Source(), h, cfg)
			}
			require.NoError(t, err)
			stop := start(t, c)
			stuck := func() string {
				for _, l := range log.lines() {
					if strings.HasPrefix(l, "ERROR ") && strings.Contains(l, "function="+tc.name+" ") {
						return l
					}
				}
				return ""
			}
			require.Eventually(t, func() bool { return stuck() != "" }, 20*time.Second, 5*time.Millisecond,
				"no error-level record of the stuck %s in %q", tc.name, log.lines())
			assert.Contains(t, stuck(), "HandlerTimeout")
			assert.Contains(t, stuck(), "event_id=deaf-"+tc.name)
			assert.Contains(t, stuck(), "bound=2s")
			assert.Equal(t, uint64(1), c.Stats().StuckCalls)
			assert.Equal(t, map[string]int64{tc.name: 1}, sums(t, reader, "once.consumer.stuck_calls", "once.function"))
			unblock()
			require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 1))
			require.NoError(t, stop())
			assert.Equal(t, map[string]int{"deaf-" + tc.name: 1}, countEffects(t, pool))
			assert.Equal(t, int32(2), runs.Load(), "the run past its timeout failed and the message ran again")
			assert.Equal(t, uint64(1), c.Stats().StuckCalls, "logged once")
		})
	}
	t.Run("returning at its deadline", func(t *testing.T) {
		t.Parallel()
		pool, _ := pgtest.Schema(t)
		effects(t, pool)
		b := memsource.New(memsource.Options{Streams: 1})
		publish(b, "prompt", 1)
		log := &levelLog{}
		cfg := fastConfig("prompt")
		cfg.Telemetry.Logger = slog.New(log)
		// The handler returns a quarter of HandlerTimeout after its
		// deadline: a watchdog that logged at HandlerTimeout, ticking
		// every quarter of it, sees it late on every run, and a loaded
		// machine's scheduling has three quarters to spare before twice
		// HandlerTimeout (20 ms, and 5 ms late, left it 15 ms).
		cfg.HandlerTimeout = 400 * time.Millisecond
		cfg.Retry.MaxAttempts = 4
		var runs atomic.Int32
		h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
			if runs.Add(1) < 4 {
				<-ctx.Done()
				time.Sleep(cfg.HandlerTimeout / 4) // returns a little after its deadline, well within twice it
				return ctx.Err()
			}
			return insertEffect(ctx, tx, ev)
		}
		c, err := consumer.New(pool, b.Source(), h, cfg)
		require.NoError(t, err)
		stop := start(t, c)
		require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 1))
		require.NoError(t, stop())
		assert.Equal(t, int32(4), runs.Load())
		assert.Zero(t, c.Stats().StuckCalls, "a handler that returned at its deadline was reported: %q", log.lines())
	})
}

// Preparing a message calls the user's functions one after another under
// one entry of the watchdog's: an EventID past HandlerTimeout is logged,
// and when it returns and the Decoder after it hangs, that hang is logged
// too, naming the Decoder and timed from its own start. The entry kept the
// first function's start and its "logged" mark: the Decoder that held
// the stream for good was never reported, and the only record named the
// EventID, which had long returned.
func TestStuckDecoderAfterASlowEventIDIsLogged(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "slow-then-stuck", 1)
	releaseID, releaseDecoder := make(chan struct{}), make(chan struct{})
	unblockID, unblockDecoder := sync.OnceFunc(func() { close(releaseID) }), sync.OnceFunc(func() { close(releaseDecoder) })
	defer unblockID() // a failed wait must not leave the functions blocked
	defer unblockDecoder()
	var idOnce, decoderOnce sync.Once
	log := &levelLog{}
	cfg := fastConfig("slow-then-stuck")
	cfg.Telemetry.Logger = slog.New(log)
	cfg.HandlerTimeout = 100 * time.Millisecond
	cfg.Identify.EventID = func(m *consumer.Message) (string, error) {
		idOnce.Do(func() { <-releaseID })
		return m.Headers["id"], nil
	}
	cfg.Decoder = func(data []byte, v any) error {
		decoderOnce.Do(func() { <-releaseDecoder })
		return consumer.JSON(data, v)
	}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error { return insertEffect(ctx, tx, ev) }
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	stuck := func(fn string) string {
		for _, l := range log.lines() {
			if strings.HasPrefix(l, "ERROR ") && strings.Contains(l, "function="+fn+" ") {
				return l
			}
		}
		return ""
	}
	require.Eventually(t, func() bool { return stuck("Identify.EventID") != "" }, 20*time.Second, 5*time.Millisecond,
		"no error-level record of the slow EventID in %q", log.lines())
	unblockID()
	require.Eventually(t, func() bool { return stuck("Decoder") != "" }, 20*time.Second, 5*time.Millisecond,
		"the Decoder that hangs after a slow EventID was never reported: %q", log.lines())
	assert.Contains(t, stuck("Decoder"), "event_id=slow-then-stuck")
	assert.Equal(t, uint64(2), c.Stats().StuckCalls)
	unblockDecoder()
	require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 1))
	require.NoError(t, stop())
	assert.Equal(t, map[string]int{"slow-then-stuck": 1}, countEffects(t, pool))
}

// A handler that returns nil after its context ended at HandlerTimeout,
// without a statement cut by it (its work was done outside the database, or
// its statements had all answered), left its transaction whole: its effects
// commit, once, and the message is not tried again (which would repeat
// whatever it did outside the database). Only a cut statement (the
// connection closed) or an error fails the run. docs/guarantees.md and
// Config.HandlerTimeout said a run past its timeout fails whatever it
// returned.
func TestHandlerReturningNilPastItsTimeoutCommits(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "late-nil", 1)
	cfg := fastConfig("late-nil")
	cfg.HandlerTimeout = 50 * time.Millisecond
	var runs atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		runs.Add(1)
		// Its statement answers however slow the machine: under the
		// 50 ms deadline, a loaded machine's insert was cut (an error,
		// then a second run), which is not the run this test is about.
		if err := insertEffect(context.WithoutCancel(ctx), tx, ev); err != nil {
			return err
		}
		<-ctx.Done() // past its deadline, outside the database
		return nil
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.NoError(t, b.WaitAcked(deadline(t, 30*time.Second), 1))
	require.NoError(t, stop())
	assert.Equal(t, map[string]int{"late-nil": 1}, countEffects(t, pool))
	assert.Equal(t, int32(1), runs.Load())
	assert.Empty(t, b.DeadLetters())
}

// A handler that ignores its context holds Run past ShutdownTimeout, as
// Config.ShutdownTimeout says; the watchdog goes on watching it then, and
// logs it at twice HandlerTimeout as ever, naming its message: the
// watchdog's context ended at the shutdown deadline, with the work's, so
// that a Run that never returned said nothing after its "shutdown
// timeout" warning of what it waited for.
func TestHandlerHoldingRunPastShutdownIsLogged(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "deaf-at-stop", 1)
	entered, release := make(chan struct{}), make(chan struct{})
	unblock := sync.OnceFunc(func() { close(release) })
	defer unblock() // a failed wait must not leave the handler blocked
	log := &levelLog{}
	cfg := fastConfig("deaf-at-stop")
	cfg.Telemetry.Logger = slog.New(log)
	cfg.HandlerTimeout = 200 * time.Millisecond
	cfg.ShutdownTimeout = 10 * time.Millisecond
	var enteredOnce sync.Once
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		enteredOnce.Do(func() { close(entered) })
		<-release // its context ignored
		return ctx.Err()
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	<-entered
	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	stuck := func() string {
		for _, l := range log.lines() {
			if strings.HasPrefix(l, "ERROR ") && strings.Contains(l, "function=handler ") {
				return l
			}
		}
		return ""
	}
	require.Eventually(t, func() bool { return stuck() != "" }, 20*time.Second, 5*time.Millisecond,
		"Run, held past its shutdown deadline by a handler, never said which: %q", log.lines())
	assert.Contains(t, stuck(), "event_id=deaf-at-stop")
	assert.Equal(t, uint64(1), c.Stats().StuckCalls)
	unblock()
	require.NoError(t, <-stopped)
	assert.Zero(t, b.Acked(), "rolled back at the shutdown, left for redelivery")
	assert.Empty(t, countEffects(t, pool))
}
