package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/kafkaout"
)

// A rolled-back transaction's messages never reach the broker; a committed
// one's do, woken by the commit's notification (the relay's poll interval
// is a minute, longer than the test waits).
func TestRollbackPublishesNothing(t *testing.T) {
	forEachBroker(t, func(t *testing.T, b broker) {
		pool, _ := migrated(t)
		d := b.destination(t)
		r, _ := startRelay(t, pool, b.publisher(t), outbox.RelayConfig{PollInterval: time.Minute})
		require.Eventually(t, r.Leader, 10*time.Second, 5*time.Millisecond)

		ctx := context.Background()
		errRollback := errors.New("the handler failed")
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			require.NoError(t, outbox.Add(ctx, tx, d.msg("k", "k/rolled-back")))
			return errRollback
		})
		require.ErrorIs(t, err, errRollback)
		addCommitted(t, pool, d.msg("k", "k/committed"))

		got := d.read(t, 1)
		waitRows(t, pool, "true", 0, 10*time.Second)
		// Nothing is left to publish: the table is empty, so what is on the
		// wire now is all there will ever be.
		got = d.read(t, len(got))
		require.Len(t, got, 1)
		assert.Equal(t, "k/committed", got[0].Body)
	})
}

// Every message carries its event id where the consuming side reads it,
// the type, the writer's trace context and its own headers; the relay keeps
// the order of one key across transactions.
func TestMessagesCarryIDTypeTraceAndHeaders(t *testing.T) {
	usePropagator(t, propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	forEachBroker(t, func(t *testing.T, b broker) {
		pool, _ := migrated(t)
		d := b.destination(t)
		startRelay(t, pool, b.publisher(t), outbox.RelayConfig{PollInterval: 50 * time.Millisecond, BatchSize: 7})

		tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
		sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
		ctx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
			TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}))
		const n = 40
		for i := range n / 10 {
			require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				for j := range 10 {
					m := d.msg("k", fmt.Sprintf("k/%d", i*10+j))
					m.Type, m.Headers = "order.confirmed", map[string]string{"x-tenant": "t1", "id": "overridden"}
					if i == 0 && j == 0 {
						m.ID = "order-1/confirmed"
					}
					if err := outbox.Add(ctx, tx, m); err != nil {
						return err
					}
				}
				return nil
			}))
		}
		got := d.read(t, n)
		require.Len(t, got, n)
		uuid := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
		seen := map[string]bool{}
		for i, w := range got {
			assert.Equal(t, fmt.Sprintf("k/%d", i), w.Body, "one key's messages in the order they were written")
			if i == 0 {
				assert.Equal(t, "order-1/confirmed", w.ID)
			} else {
				assert.Regexp(t, uuid, w.ID)
			}
			assert.False(t, seen[w.ID], "ids are distinct")
			seen[w.ID] = true
			assert.Equal(t, "order.confirmed", w.Type)
			assert.Equal(t, "t1", w.Headers["x-tenant"])
			assert.Equal(t, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", w.Headers["traceparent"])
		}
	})
}

// A row the broker refuses is retried MaxAttempts times, then parked with
// its error; the rows of its key written after it wait, never attempted,
// while every other key goes on. Discarding the parked row releases its
// key.
func TestRejectedRowIsParkedAndHoldsOnlyItsKey(t *testing.T) {
	forEachBroker(t, func(t *testing.T, b broker) {
		pool, _ := migrated(t)
		d := b.destination(t)
		warns := &atomic.Int64{}
		rd := sdkmetric.NewManualReader()
		startRelay(t, pool, b.publisher(t), outbox.RelayConfig{
			PollInterval: 20 * time.Millisecond, MaxAttempts: 3,
			RetryBackoff:  outbox.Backoff{Initial: 50 * time.Millisecond, Max: 100 * time.Millisecond},
			Logger:        countingLogger(warns),
			MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd)),
		})
		addCommitted(t, pool, d.msg("a", "a/1"), d.unroutable("a", "a/2"), d.msg("b", "b/1"))
		waitRows(t, pool, "attempts > 0", 1, 30*time.Second)
		// a/3 goes where a/2 goes (the same topic or exchange, the same
		// key): it must wait behind a/2. b/2 and c/1 go on.
		addCommitted(t, pool, d.unroutable("a", "a/3"), d.msg("b", "b/2"), d.msg("c", "c/1"))

		store, err := outbox.New(outbox.Config{})
		require.NoError(t, err)
		ctx := context.Background()
		var parked []outbox.ParkedRow
		require.Eventually(t, func() bool {
			parked, err = store.Parked(ctx, pool, 0)
			require.NoError(t, err)
			return len(parked) == 1
		}, 30*time.Second, 10*time.Millisecond)
		assert.Equal(t, 3, parked[0].Attempts)
		assert.NotEmpty(t, parked[0].LastError)
		assert.Equal(t, []byte("a"), parked[0].Key)

		got := d.read(t, 4)
		waitRows(t, pool, "true", 2, 10*time.Second) // a/2 (parked) and a/3 (held)
		assert.ElementsMatch(t, []string{"a/1", "b/1", "b/2", "c/1"}, bodies(got))
		assert.Equal(t, 1, rows(t, pool, "parked_at IS NULL AND attempts = 0"), "a/3 was never attempted")
		waitRows(t, pool, "waiting", 1, 10*time.Second) // a/3, once the relay marks it
		st, err := store.Status(ctx, pool)
		require.NoError(t, err)
		assert.Equal(t, outbox.Status{Pending: 1, Waiting: 1, Parked: 1, OldestPending: st.OldestPending}, st)
		assert.False(t, st.OldestPending.IsZero())

		n, err := store.Discard(ctx, pool, parked[0].Seq)
		require.NoError(t, err)
		require.EqualValues(t, 1, n)
		// Released, a/3 is attempted now (and parked in turn: it is
		// unroutable too).
		waitRows(t, pool, "parked_at IS NOT NULL AND attempts = 3", 1, 30*time.Second)
		assert.Positive(t, warns.Load(), "rejections are logged")
		assert.EqualValues(t, 4, metricValue(t, rd, outbox.PublishedMetric))
		// The relay counts a parked row once its transaction committed,
		// just after the row the test waited for became visible.
		require.Eventually(t, func() bool {
			return metricValue(t, rd, outbox.RejectedMetric) == 6 && metricValue(t, rd, outbox.ParkedMetric) == 2
		}, 10*time.Second, 5*time.Millisecond, "6 rejections and 2 parked rows counted")
		assert.EqualValues(t, 1, metricValue(t, rd, outbox.LeaderMetric))
	})
}

// A Kafka message larger than Producer.MaxMessageBytes is refused before it
// is sent, and the rows of its key in the same batch are not sent ahead of
// it. Requeued after the limit is raised... it is still too large, so it is
// discarded instead; the key resumes.
func TestTooLargeKafkaMessageIsParkedBeforeSending(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{
		PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond},
		Logger:       testLogger(),
	})
	big := d.msg("a", "a/2")
	big.Body = make([]byte, 100<<10)
	addCommitted(t, pool, d.msg("a", "a/1"), big, d.msg("a", "a/3"), d.msg("b", "b/1"))
	waitRows(t, pool, "parked_at IS NOT NULL AND last_error LIKE '%MaxMessageBytes%'", 1, 30*time.Second)
	got := d.read(t, 2)
	assert.ElementsMatch(t, []string{"a/1", "b/1"}, bodies(got))
	assert.Equal(t, 1, rows(t, pool, "parked_at IS NULL AND sent_at IS NULL"), "a/3 waits behind the parked row")

	store, err := outbox.New(outbox.Config{})
	require.NoError(t, err)
	parked, err := store.Parked(context.Background(), pool, 10)
	require.NoError(t, err)
	require.Len(t, parked, 1)
	_, err = store.Discard(context.Background(), pool, parked[0].Seq)
	require.NoError(t, err)
	got = d.read(t, 3)
	assert.Equal(t, []string{"a/1", "a/3"}, bodiesOfKey(got, "a"))
}

// A parked row requeued after its cause is fixed (the topic now exists) is
// published, and the row of its key written after it follows in order.
func TestRequeuedRowIsPublishedInOrder(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{
		PollInterval: 20 * time.Millisecond, MaxAttempts: 1, Logger: testLogger()})
	first := d.unroutable("a", "a/1")
	addCommitted(t, pool, first)
	waitRows(t, pool, "parked_at IS NOT NULL", 1, 30*time.Second)
	addCommitted(t, pool, outbox.Message{Topic: first.Topic, Key: []byte("a"), Body: []byte("a/2")})

	created := &kafkaDest{k: k, topic: first.Topic}
	createTopic(t, k, first.Topic)
	store, err := outbox.New(outbox.Config{})
	require.NoError(t, err)
	parked, err := store.Parked(context.Background(), pool, 0)
	require.NoError(t, err)
	require.Len(t, parked, 1)
	n, err := store.Requeue(context.Background(), pool, parked[0].Seq)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	waitRows(t, pool, "true", 0, 30*time.Second)
	assert.Equal(t, []string{"a/1", "a/2"}, bodiesOfKey(created.read(t, 2), "a"))
}

// Bad input is refused with clear errors and writes nothing.
func TestInvalidInput(t *testing.T) {
	_, err := outbox.New(outbox.Config{Table: "outbox; DROP TABLE x"})
	require.ErrorIs(t, err, outbox.ErrInvalidName)
	_, err = outbox.New(outbox.Config{Schema: `a"b`})
	require.ErrorIs(t, err, outbox.ErrInvalidName)

	pool, _ := migrated(t)
	ctx := context.Background()
	for name, m := range map[string]outbox.Message{
		"no destination": {Body: []byte("x")},
		"id too long":    {Topic: "t", ID: string(make([]byte, outbox.MaxIDLength+1))},
		"id not utf-8":   {Topic: "t", ID: "\xff"},
		"empty header":   {Topic: "t", Headers: map[string]string{"": "v"}},
		"nul in header":  {Topic: "t", Headers: map[string]string{"h": "a\x00b"}},
	} {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return outbox.Add(ctx, tx, outbox.Message{Topic: "t", Body: []byte("ok")}, m)
		})
		require.ErrorIs(t, err, outbox.ErrInvalidMessage, name)
	}
	assert.Zero(t, rows(t, pool, "true"), "an invalid message writes nothing, not even the valid ones beside it")

	pub := newKafka(t).publisher(t)
	for name, cfg := range map[string]outbox.RelayConfig{
		"negative batch":           {BatchSize: -1},
		"negative poll":            {PollInterval: -time.Second},
		"bad backoff":              {RetryBackoff: outbox.Backoff{Initial: time.Second, Max: time.Millisecond}},
		"negative keep":            {KeepSent: -time.Second},
		"negative attempt":         {MaxAttempts: -1},
		"negative publish timeout": {PublishTimeout: -time.Second},
	} {
		_, err := outbox.NewRelay(pool, pub, cfg)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, name)
	}
	_, err = outbox.NewRelay(nil, pub, outbox.RelayConfig{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	_, err = outbox.NewRelay(pool, nil, outbox.RelayConfig{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	// A publisher whose New failed, its error dropped (pub, err := ...;
	// relay, err := outbox.NewRelay(pool, pub, ...)), is a nil pointer in
	// a non-nil interface: it was accepted, and the relay parked every
	// row after MaxAttempts panics of its Check.
	var failed *kafkaout.Publisher
	_, err = outbox.NewRelay(pool, failed, outbox.RelayConfig{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig, "a nil *kafkaout.Publisher")
}

// A duration in the wrong unit (PublishTimeout: 60, meant as seconds, is 60
// ns) was accepted: every Publish got a context already past its deadline
// and failed as the broker's fault, retried without end, and no row was
// ever published; with PollInterval the relay polled back to back; with a
// backoff's Initial a refused row spent its attempts at once, and an
// outage's retries spun. NewRelay refuses each, naming the field.
func TestNewRelayRefusesDurationsBelowAMillisecond(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	for name, set := range map[string]func(*outbox.RelayConfig, time.Duration){
		"PollInterval":   func(c *outbox.RelayConfig, d time.Duration) { c.PollInterval = d },
		"PublishTimeout": func(c *outbox.RelayConfig, d time.Duration) { c.PublishTimeout = d },
		"RetryBackoff.Initial": func(c *outbox.RelayConfig, d time.Duration) {
			c.RetryBackoff = outbox.Backoff{Initial: d, Max: time.Minute}
		},
		"InfraBackoff.Initial": func(c *outbox.RelayConfig, d time.Duration) {
			c.InfraBackoff = outbox.Backoff{Initial: d, Max: 5 * time.Second}
		},
	} {
		t.Run(name, func(t *testing.T) {
			for _, d := range []time.Duration{60, time.Millisecond - 1} {
				var cfg outbox.RelayConfig
				set(&cfg, d)
				_, err := outbox.NewRelay(pool, nopPublisher{}, cfg)
				require.ErrorIs(t, err, outbox.ErrInvalidConfig, "%s %v", name, d)
				assert.Contains(t, err.Error(), name)
			}
			var cfg outbox.RelayConfig
			set(&cfg, time.Millisecond)
			_, err := outbox.NewRelay(pool, nopPublisher{}, cfg)
			require.NoError(t, err, "a millisecond is accepted")
		})
	}
}

// MaxAttempts is compared with the rows' attempts, an integer column: one
// above 2^31-1 (math.MaxInt, meant as never park) was accepted, and the
// first refused record made every settle of its batch fail to encode ("is
// greater than maximum value for int4"), taken for the database's failure
// and retried without end: the relay stood still, and no row added after
// was published. NewRelay refuses it; math.MaxInt32 is accepted.
func TestNewRelayRefusesMaxAttemptsBeyondTheColumn(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	for _, n := range []int{math.MaxInt, math.MaxInt32 + 1} {
		_, err := outbox.NewRelay(pool, nopPublisher{}, outbox.RelayConfig{MaxAttempts: n})
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, "%d", n)
		assert.Contains(t, err.Error(), "MaxAttempts")
	}
	_, err := outbox.NewRelay(pool, nopPublisher{}, outbox.RelayConfig{MaxAttempts: math.MaxInt32})
	require.NoError(t, err)
}

// Migrate is idempotent and safe from many processes at once; the table can
// live in a named schema.
func TestMigrateConcurrentlyAndInASchema(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	store, err := outbox.New(outbox.Config{Schema: schema, Table: "events_out"})
	require.NoError(t, err)
	errs := make(chan error, 4)
	for range 4 {
		go func() { errs <- store.Migrate(context.Background(), pool) }()
	}
	for range 4 {
		require.NoError(t, <-errs)
	}
	require.NoError(t, store.Add(context.Background(), pool, outbox.Message{Topic: "t", Body: []byte("x")}))
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM `+store.Table()).Scan(&n))
	assert.Equal(t, 1, n)
}

// Services that share a database each keep their tables in a schema of
// their own, first on their search_path, with a common schema after it:
// Config.Schema is "". The schema version is recorded beside the outbox
// table, so each service's table is created, whatever the common schema
// holds: the version table that another component created there was taken
// for the store's, the first service's version recorded in it, and the
// second service, finding its table recorded, created none (its Add and
// its relay then failed on a missing table).
func TestMigrateRecordsVersionsBesideTheTableOnTheSearchPath(t *testing.T) {
	ctx := context.Background()
	common, pub := pgtest.Schema(t)
	_, a := pgtest.Schema(t)
	_, b := pgtest.Schema(t)
	// Another component's versions in the common schema.
	other, err := outbox.New(outbox.Config{Table: "audit_out"})
	require.NoError(t, err)
	require.NoError(t, other.Migrate(ctx, common))

	for _, svc := range []string{a, b} {
		pool := pgtest.NewPool(t, svc+", "+pub)
		require.NoError(t, outbox.Migrate(ctx, pool), svc)
		var n int
		if assert.NoError(t, outbox.Add(ctx, pool, outbox.Message{Topic: "t", Body: []byte("x")}), svc) {
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{svc, "outbox"}.Sanitize()).Scan(&n))
			assert.Equal(t, 1, n, "the row is in %s's table", svc)
		}
		assert.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{svc, "once_schema_versions"}.Sanitize()+
			` WHERE component = 'outbox:outbox' AND version = 1`).Scan(&n), svc)
		assert.Equal(t, 1, n, "recorded beside %s's table", svc)
	}
}

// With KeepSent, published rows stay (marked sent) and are removed after
// the window. The rows kept are looked for before the topic is read, and
// for a window of seconds: on a loaded machine, reading the topic first
// took longer than a window of one, and the rows were gone when looked for.
func TestKeepSentRemovesRowsAfterTheWindow(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, KeepSent: 5 * time.Second})
	addCommitted(t, pool, d.msg("a", "a/1"), d.msg("a", "a/2"))
	waitRows(t, pool, "sent_at IS NOT NULL", 2, 20*time.Second)
	d.read(t, 2)
	waitRows(t, pool, "true", 0, 30*time.Second)
}

func bodies(ws []wire) []string {
	out := make([]string, len(ws))
	for i, w := range ws {
		out[i] = w.Body
	}
	return out
}

func bodiesOfKey(ws []wire, key string) []string {
	var out []string
	for _, w := range ws {
		if w.Key == key {
			out = append(out, w.Body)
		}
	}
	return out
}

// On RabbitMQ, a message to an exchange that does not exist closes the
// channel: that message is refused, the others of the batch are published
// again on a new channel (their first publish may have arrived: copies
// with the same id), and the next attempts of the refused message are
// checked before the batch is sent, so that it is parked without closing
// the channel again.
func TestMissingExchangeIsParkedOthersGoOn(t *testing.T) {
	r := rabbitOrSkip(t)
	pool, _ := migrated(t)
	d := r.destination(t)
	startRelay(t, pool, r.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond}})
	nowhere := outbox.Message{Topic: uniq("no-such-exchange"), RoutingKey: "x", Key: []byte("a"), Body: []byte("a/1")}
	addCommitted(t, pool, d.msg("b", "b/1"), nowhere, d.msg("c", "c/1"), d.msg("b", "b/2"))
	waitRows(t, pool, "parked_at IS NOT NULL AND last_error LIKE '%does not exist%'", 1, 30*time.Second)
	waitRows(t, pool, "true", 1, 30*time.Second)
	all := d.read(t, 3)
	_, copies := ids(all)
	for id, n := range copies {
		assert.LessOrEqual(t, n, 2, "%s: one channel close, so at most one extra copy", id)
	}
	got := firstCopies(all)
	assert.Equal(t, []string{"b/1", "b/2"}, bodiesOfKey(got, "b"))
	assert.Equal(t, []string{"c/1"}, bodiesOfKey(got, "c"))
}

// firstCopies drops the copies of a message after its first: what a
// deduplicating consumer sees.
func firstCopies(ws []wire) []wire {
	seen := map[string]bool{}
	var out []wire
	for _, w := range ws {
		if !seen[w.ID] {
			seen[w.ID] = true
			out = append(out, w)
		}
	}
	return out
}

// The relay reads the next batch while the broker works on the current
// one; a row read ahead whose key had a row refused in the current batch
// is put back, not sent, so that it never overtakes that row.
func TestRowsReadAheadWaitBehindARefusedRow(t *testing.T) {
	forEachBroker(t, func(t *testing.T, b broker) {
		pool, _ := migrated(t)
		d := b.destination(t)
		startRelay(t, pool, b.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, BatchSize: 2, MaxAttempts: 2,
			RetryBackoff: outbox.Backoff{Initial: 20 * time.Millisecond, Max: 20 * time.Millisecond}, Logger: testLogger()})
		// Batch one: a/1, a/2 (refused); read ahead: a/3 (behind a/2), b/1.
		addCommitted(t, pool, d.msg("a", "a/1"), d.unroutable("a", "a/2"), d.unroutable("a", "a/3"), d.msg("b", "b/1"), d.msg("b", "b/2"))
		waitRows(t, pool, "parked_at IS NOT NULL", 1, 30*time.Second)
		got := d.read(t, 3)
		waitRows(t, pool, "true", 2, 10*time.Second)
		assert.ElementsMatch(t, []string{"a/1", "b/1", "b/2"}, bodies(firstCopies(got)))
		assert.Equal(t, 1, rows(t, pool, "parked_at IS NULL AND attempts = 0"), "a/3 was never attempted")
	})
}

// Rows whose notification never came (here: inserted with the trigger
// disabled) are published by the poll.
func TestPollingFindsRowsWithoutANotification(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	_, err := pool.Exec(context.Background(), `ALTER TABLE outbox DISABLE TRIGGER USER`)
	require.NoError(t, err)
	r, _ := startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 50 * time.Millisecond, Logger: testLogger()})
	require.Eventually(t, r.Leader, 10*time.Second, 5*time.Millisecond)
	addCommitted(t, pool, d.msg("a", "a/1"), d.msg("a", "a/2"))
	assert.Equal(t, []string{"a/1", "a/2"}, bodies(d.read(t, 2)))
	waitRows(t, pool, "true", 0, 10*time.Second)
}

// Store.Statement queued with a consumer handler's ev.Queue writes the
// outbox rows with the handler's other statements, in its transaction.
func TestStatementQueuedByAHandler(t *testing.T) {
	pool, _ := migrated(t)
	store, err := outbox.New(outbox.Config{})
	require.NoError(t, err)
	mem := memsource.New(memsource.Options{Streams: 1})
	for i := range 3 {
		mem.Publish(consumer.Message{ID: fmt.Sprintf("in-%d", i), Value: []byte(`"x"`)})
	}
	handle := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[string]) error {
		sql, args, err := store.Statement(ctx, outbox.Message{ID: ev.ID + "/out", Topic: "next", Body: []byte(ev.Payload)})
		if err != nil {
			return consumer.Permanent(err)
		}
		ev.Queue(sql, args...)
		return nil
	}
	c, err := consumer.New(pool, mem.Source(), handle, consumer.Config{Name: "queue-test", Telemetry: consumer.TelemetryConfig{Logger: testLogger()}})
	require.NoError(t, err)
	run(t, c.Run)
	waitRows(t, pool, "event_id LIKE 'in-%/out' AND topic = 'next'", 3, 10*time.Second)
}

// The relay's batch span is a producer span linked to the span that wrote
// each row; the message itself carries the writer's trace context.
func TestRelaySpanLinksToTheWriters(t *testing.T) {
	usePropagator(t, propagation.TraceContext{})
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	ctx, writer := tp.Tracer("handler").Start(context.Background(), "handle order.paid")
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return outbox.Add(ctx, tx, d.msg("a", "a/1")) }))
	writer.End()

	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, TracerProvider: tp, Logger: testLogger()})
	got := d.read(t, 1)
	assert.Equal(t, writer.SpanContext().TraceID().String(), strings.Split(got[0].Headers["traceparent"], "-")[1])
	var publish sdktrace.ReadOnlySpan
	require.Eventually(t, func() bool {
		for _, s := range rec.Ended() {
			if s.Name() == "outbox publish" {
				publish = s
				return true
			}
		}
		return false
	}, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, trace.SpanKindProducer, publish.SpanKind())
	require.Len(t, publish.Links(), 1)
	assert.Equal(t, writer.SpanContext().SpanID(), publish.Links()[0].SpanContext.SpanID())
}

// A relay on a table with its own name in a named schema publishes it; a
// second table beside it has a leader of its own.
func TestRelayOnNamedTables(t *testing.T) {
	k := newKafka(t)
	pool, schema := pgtest.Schema(t)
	d := k.destination(t)
	ctx := context.Background()
	for _, table := range []string{"orders_out", "billing_out"} {
		store, err := outbox.New(outbox.Config{Schema: schema, Table: table})
		require.NoError(t, err)
		r, _ := startRelay(t, pool, k.publisher(t), outbox.RelayConfig{Store: store, PollInterval: 20 * time.Millisecond})
		require.Eventually(t, r.Leader, 10*time.Second, 5*time.Millisecond, "%s has a leader of its own", table)
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return store.Add(ctx, tx, d.msg(table, table+"/0"))
		}))
	}
	assert.ElementsMatch(t, []string{"orders_out/0", "billing_out/0"}, bodies(d.read(t, 2)))
}

// One event published to two destinations under one id (Message.ID set by
// the writer): when one copy is returned unroutable, only that row is
// refused; the other was delivered and is settled as sent, not charged,
// republished and parked.
func TestUnroutableCopyDoesNotRefuseItsTwinOfTheSameID(t *testing.T) {
	r := rabbitOrSkip(t)
	pool, _ := migrated(t)
	d := r.destination(t)
	startRelay(t, pool, r.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond}})
	routed, lost := d.msg("a", "a/1"), d.unroutable("z", "z/1")
	routed.ID, lost.ID = "order-1/confirmed", "order-1/confirmed"
	addCommitted(t, pool, routed, lost, d.msg("a", "a/2"))
	waitRows(t, pool, "parked_at IS NULL", 0, 30*time.Second)
	assert.Equal(t, 1, rows(t, pool, "true"), "only the unroutable row is left")
	assert.Equal(t, 1, rows(t, pool, "parked_at IS NOT NULL AND body = 'z/1'"), "and it is the one parked")
	got := d.read(t, 2)
	assert.Equal(t, []string{"a/1", "a/2"}, bodiesOfKey(got, "a"), "each delivered once, in order")
}

// gatedPublisher holds its first Publish until release is closed.
type gatedPublisher struct {
	outbox.Publisher
	entered chan struct{}
	release chan struct{}
	calls   atomic.Int64
}

func (g *gatedPublisher) Publish(ctx context.Context, recs []outbox.Record) []error {
	if g.calls.Add(1) == 1 {
		g.entered <- struct{}{}
		<-g.release
	}
	return g.Publisher.Publish(ctx, recs)
}

// A notification that reaches the relay while it is busy with a batch
// (here: waiting for the broker's confirms) wakes it once the batch is
// done, not a PollInterval later; and notifications are not kept.
func TestNotificationDuringABatchWakesTheRelay(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	pub := &gatedPublisher{Publisher: k.publisher(t), entered: make(chan struct{}, 1), release: make(chan struct{})}
	r, _ := startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: time.Minute})
	require.Eventually(t, r.Leader, 10*time.Second, 5*time.Millisecond)
	addCommitted(t, pool, d.msg("a", "a/1"))
	select {
	case <-pub.entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the relay never published a/1")
	}
	addCommitted(t, pool, d.msg("b", "b/1")) // notifies the relay while it waits for the broker
	close(pub.release)
	waitRows(t, pool, "true", 0, 10*time.Second)
	assert.ElementsMatch(t, []string{"a/1", "b/1"}, bodies(d.read(t, 2)))
}

// An outbox partitioned by ranges of seq (to drop old partitions of a
// large table; its key, seq, holds the partition key, and Migrate takes
// the table as it is) has rows of the same ctid in each partition: the
// removal of rows kept past KeepSent named rows by ctid alone, and took
// with each expired row the rows of that ctid in the other partitions,
// pending ones included, which were then never published. Only the
// expired rows go now.
func TestKeepSentOnRangePartitionedTable(t *testing.T) {
	k := newKafka(t)
	pool, _ := pgtest.Schema(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE outbox (
    seq         bigint      GENERATED ALWAYS AS IDENTITY,
    event_id    text        NOT NULL,
    topic       text        NOT NULL,
    routing_key text        NOT NULL DEFAULT '',
    key         bytea,
    type        text        NOT NULL DEFAULT '',
    headers     jsonb       NOT NULL DEFAULT '{}',
    trace       jsonb       NOT NULL DEFAULT '{}',
    body        bytea       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    attempts    integer     NOT NULL DEFAULT 0,
    not_before  timestamptz,
    last_error  text,
    parked_at   timestamptz,
    sent_at     timestamptz,
    PRIMARY KEY (seq)
) PARTITION BY RANGE (seq);
CREATE TABLE outbox_p0 PARTITION OF outbox FOR VALUES FROM (MINVALUE) TO (1000);
CREATE TABLE outbox_p1 PARTITION OF outbox FOR VALUES FROM (1000) TO (MAXVALUE)`)
	require.NoError(t, err)
	require.NoError(t, outbox.Migrate(ctx, pool))
	d := k.destination(t)
	// 100 rows sent a day ago in the first partition, 100 to publish in
	// the second: the same ctids.
	_, err = pool.Exec(ctx, `INSERT INTO outbox (event_id, topic, body, sent_at)
SELECT 'old-' || i, 'nowhere', '', now() - interval '1 day' FROM generate_series(1, 100) i`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `SELECT setval(pg_get_serial_sequence('outbox', 'seq'), 999)`)
	require.NoError(t, err)
	msgs := make([]outbox.Message, 100)
	for i := range msgs {
		msgs[i] = d.msg(fmt.Sprint("k", i%7), fmt.Sprint("m", i))
	}
	addCommitted(t, pool, msgs...)

	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, BatchSize: 10, KeepSent: time.Hour})
	waitRows(t, pool, "sent_at IS NULL OR sent_at < now() - interval '1 hour'", 0, 30*time.Second)
	assert.Equal(t, 100, rows(t, pool, "sent_at IS NOT NULL"), "every row to publish was published and kept")
	got, _ := ids(d.read(t, 100))
	assert.Len(t, got, 100)
}

// With KeepSent, removing the rows kept past the window went on, a chunk
// after a chunk, until none was left, and the relay published nothing
// meanwhile: a busy relay that kept a minute's rows paused its publishing
// for as long as deleting them took. Each pass is bounded now, and the
// relay publishes between passes: a row added once the removal has begun
// is published while expired rows are still there.
func TestKeepSentCleanupDoesNotHoldPublishing(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	ctx := context.Background()
	const expired = 300_000
	_, err := pool.Exec(ctx, `INSERT INTO outbox (event_id, topic, body, sent_at)
SELECT 'old-' || i, 'nowhere', '', now() - interval '1 day' FROM generate_series(1, $1) i`, expired)
	require.NoError(t, err)
	d := k.destination(t)
	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, KeepSent: time.Hour})
	require.Eventually(t, func() bool { return rows(t, pool, "sent_at < now() - interval '1 hour'") < expired },
		30*time.Second, time.Millisecond, "the removal begins")
	addCommitted(t, pool, d.msg("k", "fresh"))
	// Both counts from one snapshot: the fresh row marked sent, and how
	// many expired rows were left then.
	var left, sent int
	require.Eventually(t, func() bool {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE sent_at < now() - interval '1 hour'),
	count(*) FILTER (WHERE event_id NOT LIKE 'old-%' AND sent_at IS NOT NULL) FROM outbox`).Scan(&left, &sent))
		return sent == 1
	}, 60*time.Second, time.Millisecond)
	assert.Positive(t, left, "the fresh row was published before the expired rows were all removed")
	d.read(t, 1)
	waitRows(t, pool, "sent_at < now() - interval '1 hour'", 0, 120*time.Second)
}

// RelayConfig says every field has a default, but a backoff with one half
// set (RetryBackoff{Max: 10 * time.Second}, to shorten the retries) was
// refused as "needs 0 < Initial <= Max", while the consumer's Retry and
// InfraBackoff fill in the half left out. The relay fills it in the same
// way: Initial is the default capped at Max, Max the default or Initial
// when that is longer.
func TestNewRelayFillsInTheHalfOfABackoffLeftOut(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	for name, cfg := range map[string]outbox.RelayConfig{
		"RetryBackoff.Max below its default Initial": {RetryBackoff: outbox.Backoff{Max: 500 * time.Millisecond}},
		"RetryBackoff.Initial above its default Max": {RetryBackoff: outbox.Backoff{Initial: 2 * time.Minute}},
		"InfraBackoff.Max alone":                     {InfraBackoff: outbox.Backoff{Max: time.Second}},
		"InfraBackoff.Initial alone":                 {InfraBackoff: outbox.Backoff{Initial: 10 * time.Second}},
	} {
		_, err := outbox.NewRelay(pool, nopPublisher{}, cfg)
		require.NoError(t, err, name)
	}
	_, err := outbox.NewRelay(pool, nopPublisher{}, outbox.RelayConfig{
		RetryBackoff: outbox.Backoff{Initial: time.Minute, Max: time.Second}})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig, "both halves set, and Initial above Max, is still refused")
}
