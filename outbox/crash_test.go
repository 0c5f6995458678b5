package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/amqpout"
	"github.com/onceco/once/outbox/kafkaout"
)

// The crash child: the test binary run again with these variables set runs
// a relay whose process kills itself (SIGKILL) as soon as the broker has
// confirmed the first batch, before the rows are marked.
const (
	childEnv       = "ONCE_OUTBOX_CHILD" // "kafka" or "rabbitmq"
	childDBEnv     = "ONCE_OUTBOX_CHILD_DB"
	childSchemaEnv = "ONCE_OUTBOX_CHILD_SCHEMA"
	childBrokerEnv = "ONCE_OUTBOX_CHILD_BROKER" // Kafka address or AMQP URL
	// childModeEnv "run" makes the child relay until it is killed.
	childModeEnv = "ONCE_OUTBOX_CHILD_MODE"
)

func runChild() int {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(os.Getenv(childDBEnv))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = os.Getenv(childSchemaEnv)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	var pub outbox.Publisher
	switch os.Getenv(childEnv) {
	case "kafka":
		pub, err = kafkaout.New(kafkaout.Config{Brokers: []string{os.Getenv(childBrokerEnv)}, Sarama: saramaConfig()})
	default:
		pub, err = amqpout.New(amqpout.Config{URL: os.Getenv(childBrokerEnv)})
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	rcfg := outbox.RelayConfig{PollInterval: 50 * time.Millisecond, Logger: testLogger()}
	if os.Getenv(childModeEnv) == "run" {
		rcfg.BatchSize = 50 // more batches, more moments to be killed in
	} else {
		pub = killAfterConfirm{pub}
	}
	r, err := outbox.NewRelay(pool, pub, rcfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	_ = r.Run(ctx)
	return 3 // not reached: the child is killed
}

// killAfterConfirm kills the process once the broker confirmed a whole
// batch: the crash between publish and mark.
type killAfterConfirm struct{ outbox.Publisher }

func (k killAfterConfirm) Publish(ctx context.Context, recs []outbox.Record) []error {
	errs := k.Publisher.Publish(ctx, recs)
	if errs == nil {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	return errs
}

// A relay killed after the broker confirmed a batch and before it marked
// the rows leaves them in the outbox; the next relay publishes them again
// with the same ids, and a consumer of this library downstream skips every
// second copy: one effect per event.
func TestCrashAfterPublishBeforeMarkIsSkippedDownstream(t *testing.T) {
	forEachBroker(t, func(t *testing.T, b broker) {
		pool, schema := migrated(t)
		d := b.destination(t)
		const n = 60
		for i := range n / 20 {
			var msgs []outbox.Message
			for j := range 20 {
				key := fmt.Sprintf("k%d", j%4)
				msgs = append(msgs, d.msg(key, fmt.Sprintf("%s/%d", key, i*20+j)))
			}
			addCommitted(t, pool, msgs...)
		}

		runCrashChild(t, b, schema)
		assert.Equal(t, n, rows(t, pool, "sent_at IS NULL"), "the killed relay marked nothing")
		if kd, ok := d.(*kafkaDest); ok {
			require.Len(t, kd.read(t, n), n, "the killed relay's batch reached the broker")
		}

		_, err := pool.Exec(context.Background(), `CREATE TABLE effects (event_id text NOT NULL, body text NOT NULL)`)
		require.NoError(t, err)
		effect := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[[]byte]) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, $2)`, ev.ID, string(ev.Payload))
			return err
		}
		c, err := consumer.New(pool, d.source(t, "shipping"), effect, consumer.Config{Name: "shipping", Telemetry: consumer.TelemetryConfig{Logger: testLogger()}})
		require.NoError(t, err)
		stopConsumer := run(t, c.Run)
		startRelay(t, pool, b.publisher(t), outbox.RelayConfig{PollInterval: 50 * time.Millisecond})

		waitRows(t, pool, "true", 0, 30*time.Second)
		require.Eventually(t, func() bool { st := c.Stats(); return st.Handled+st.Duplicates >= 2*n },
			60*time.Second, 10*time.Millisecond, "the consumer settles both copies of each message")
		stopConsumer()

		var events, effects int
		require.NoError(t, pool.QueryRow(context.Background(),
			`SELECT count(DISTINCT event_id), count(*) FROM effects`).Scan(&events, &effects))
		assert.Equal(t, n, events, "every event has its effect")
		assert.Equal(t, n, effects, "and only one")
		st := c.Stats()
		assert.EqualValues(t, n, st.Handled)
		assert.EqualValues(t, n, st.Duplicates, "each re-published copy is skipped as a duplicate")
		assert.Zero(t, st.DeadLettered, "a re-publish has the same payload: no id conflict")
		if kd, ok := d.(*kafkaDest); ok {
			_, copies := ids(kd.read(t, 2*n))
			for id, c := range copies {
				assert.Equal(t, 2, c, "id %s: once from the killed relay, once from the next", id)
			}
		}
	})
}

// runCrashChild runs the crash child on the test's schema and requires that
// it died of SIGKILL.
func runCrashChild(t *testing.T, b broker, schema string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := childCommand(ctx, b, schema, "crash")
	err := cmd.Run()
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "the child must die, got %v", err)
	ws, ok := exit.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "the child must die of SIGKILL: %v", err)
}

// childCommand is the test binary run as a relay child on schema.
func childCommand(ctx context.Context, b broker, schema, mode string) *exec.Cmd {
	var kind, addr string
	switch b := b.(type) {
	case *kafkaBroker:
		kind, addr = "kafka", b.addrs[0]
	case *rabbit:
		kind, addr = "rabbitmq", b.url
	}
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+kind, childDBEnv+"="+pgtest.URL(), childSchemaEnv+"="+schema,
		childBrokerEnv+"="+addr, childModeEnv+"="+mode)
	cmd.Stderr = os.Stderr
	return cmd
}

// run runs f in a goroutine until the returned stop (also called when the
// test ends) cancels its context; f's error is checked.
func run(t testing.TB, f func(ctx context.Context) error) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				assert.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Error("did not stop within 30s")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// stopAfterPublisher cancels the relay's context right after the broker
// confirmed its n-th batch.
type stopAfterPublisher struct {
	outbox.Publisher
	n       int64
	calls   atomic.Int64
	stop    context.CancelFunc
	records atomic.Int64
}

func (p *stopAfterPublisher) Publish(ctx context.Context, recs []outbox.Record) []error {
	errs := p.Publisher.Publish(ctx, recs)
	p.records.Add(int64(len(recs)))
	if p.calls.Add(1) == p.n {
		p.stop()
	}
	return errs
}

// A relay leaves the delete of a fully confirmed batch to be sent with
// the read after the next one; a relay stopped just then still deletes it
// before Run returns: the batches the broker confirmed are gone from the
// table, the rest wait for the next leader, and nothing is published twice.
func TestStoppedRelayDeletesWhatTheBrokerConfirmed(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	const batch, batches = 10, 6
	var msgs []outbox.Message
	for i := range batch * batches {
		msgs = append(msgs, d.msg(fmt.Sprintf("k%d", i%3), fmt.Sprintf("m%02d", i)))
	}
	addCommitted(t, pool, msgs...)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Stopped after the second batch: the first batch's delete went out
	// with the read of the third, the second's is still to be sent.
	pub := &stopAfterPublisher{Publisher: k.publisher(t), n: 2, stop: cancel}
	r, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{BatchSize: batch, Logger: testLogger()})
	require.NoError(t, err)
	require.NoError(t, r.Run(ctx))

	published := int(pub.records.Load())
	require.Equal(t, 2*batch, published, "two batches were published")
	assert.Equal(t, batch*batches-published, rows(t, pool, "true"), "every confirmed row deleted, the others kept")
	got := d.read(t, published)
	distinct, seen := ids(got)
	assert.Len(t, distinct, published, "every confirmed row arrived")
	assert.Len(t, got, published, "no copy beyond the confirmed rows")
	for id, n := range seen {
		assert.Equal(t, 1, n, "%s published once", id)
	}
}

// stopDuringPublish cancels the relay's context as its first publish
// starts, then publishes: the broker answers while the relay is stopping.
type stopDuringPublish struct {
	outbox.Publisher
	stop context.CancelFunc
}

func (p *stopDuringPublish) Publish(ctx context.Context, recs []outbox.Record) []error {
	p.stop()
	return p.Publisher.Publish(ctx, recs)
}

// A relay stopped while its publish is in flight still waits (within its
// grace) for the broker's answer and deletes what the broker confirmed:
// the publish is not cut short by the stop, which would leave rows the
// broker has, and a consumer may already have handled, to be published
// again.
func TestRelayStoppedMidPublishDeletesWhatTheBrokerConfirmed(t *testing.T) {
	forEachBroker(t, func(t *testing.T, b broker) {
		pool, _ := migrated(t)
		d := b.destination(t)
		msgs := []outbox.Message{d.msg("a", "a/1"), d.msg("a", "a/2"), d.msg("b", "b/1")}
		addCommitted(t, pool, msgs...)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		r, err := outbox.NewRelay(pool, &stopDuringPublish{Publisher: b.publisher(t), stop: cancel}, outbox.RelayConfig{Logger: testLogger()})
		require.NoError(t, err)
		require.NoError(t, r.Run(ctx))

		got := d.read(t, len(msgs))
		assert.Len(t, got, len(msgs), "the broker has every row")
		assert.Zero(t, rows(t, pool, "true"), "every row the broker confirmed is deleted")
	})
}

// tableLock is an ACCESS EXCLUSIVE lock on the outbox table that a test's
// publisher takes at a chosen moment of the relay's work; locked is closed
// once it was tried (err says how).
type tableLock struct {
	pool   *pgxpool.Pool
	tx     pgx.Tx
	err    error
	locked chan struct{}
}

func newTableLock(pool *pgxpool.Pool) tableLock {
	return tableLock{pool: pool, locked: make(chan struct{})}
}

// take locks the table in a transaction of its own, unless err is set.
func (l *tableLock) take() {
	defer close(l.locked)
	if l.err != nil {
		return
	}
	if l.tx, l.err = l.pool.Begin(context.Background()); l.err == nil {
		_, l.err = l.tx.Exec(context.Background(), `LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE`)
	}
}

func (l *tableLock) lock() *tableLock { return l }

// lockOnCheck takes the table lock when the relay checks the first record
// of its first batch: the read of the next batch, which the relay sends
// while the broker works on this one, then waits for the lock.
type lockOnCheck struct {
	outbox.Publisher
	tableLock
	once sync.Once
	done atomic.Int64
}

func (p *lockOnCheck) Check(rec outbox.Record) error {
	p.once.Do(p.take)
	return p.Publisher.(outbox.Checker).Check(rec)
}

func (p *lockOnCheck) Publish(ctx context.Context, recs []outbox.Record) []error {
	errs := p.Publisher.Publish(ctx, recs)
	p.done.Add(1)
	return errs
}

// A relay stopped while it reads the next batch ahead (a full batch in
// flight) still deletes the rows of the batch the broker confirmed: the
// stop does not cut the read short, which would close the relay's
// connection and leave the confirmed rows to be published again.
func TestRelayStoppedWhileReadingAheadDeletesWhatTheBrokerConfirmed(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	const batch = 5
	pub := &lockOnCheck{Publisher: k.publisher(t), tableLock: newTableLock(pool)}
	// The read ahead waits for the lock, and the broker confirmed the batch.
	stopRelayWhileLocked(t, pool, d, pub, outbox.RelayConfig{BatchSize: batch}, func() bool { return pub.done.Load() == 1 })

	assert.Equal(t, 3, rows(t, pool, "true"), "the confirmed batch is deleted, the rows read ahead are kept")
	got := d.read(t, batch)
	assert.Len(t, got, batch, "the broker has the batch once")
}

// stopRelayWhileLocked adds BatchSize + 3 committed rows of two keys for
// d, runs a relay with pub and cfg, and stops it once pub's table lock
// holds up one of the relay's statements (and also holds); then it lets
// the relay go on, and waits until Run returned nil.
func stopRelayWhileLocked(t *testing.T, pool *pgxpool.Pool, d dest, pub interface {
	outbox.Publisher
	lock() *tableLock
}, cfg outbox.RelayConfig, also func() bool) {
	t.Helper()
	var msgs []outbox.Message
	for i := range cfg.BatchSize + 3 {
		msgs = append(msgs, d.msg(fmt.Sprintf("k%d", i%2), fmt.Sprintf("m%02d", i)))
	}
	addCommitted(t, pool, msgs...)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cfg.Logger = testLogger()
	r, err := outbox.NewRelay(pool, pub, cfg)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()

	l := pub.lock()
	<-l.locked
	require.NoError(t, l.err)
	defer func() { _ = l.tx.Rollback(context.Background()) }()
	require.Eventually(t, func() bool {
		var waiting int
		err := pool.QueryRow(context.Background(),
			`SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'outbox'::regclass`).Scan(&waiting)
		return err == nil && waiting == 1 && also()
	}, 20*time.Second, 10*time.Millisecond)
	cancel()
	require.NoError(t, l.tx.Rollback(context.Background()))
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("the relay did not stop")
	}
}

// lockAfterReadAhead takes an ACCESS EXCLUSIVE lock on the outbox table
// once the relay has read the next batch ahead of its first one, before
// the broker's answer to the first is handed back: the relay's next
// statement on the table waits for the lock.
type lockAfterReadAhead struct {
	outbox.Publisher
	tableLock
	checked time.Time // the database's clock at the first Check
	calls   atomic.Int64
}

func (p *lockAfterReadAhead) Check(rec outbox.Record) error {
	if p.checked.IsZero() {
		p.err = p.pool.QueryRow(context.Background(), `SELECT clock_timestamp()`).Scan(&p.checked)
	}
	return p.Publisher.(outbox.Checker).Check(rec)
}

func (p *lockAfterReadAhead) Publish(ctx context.Context, recs []outbox.Record) []error {
	errs := p.Publisher.Publish(ctx, recs)
	if p.calls.Add(1) > 1 || p.err != nil {
		return errs
	}
	// The relay's read (plain, or marking rows waiting) has ended: the
	// statement its session ran last, idle now.
	deadline := time.Now().Add(30 * time.Second)
	for p.err == nil {
		var n int
		p.err = p.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid()
	AND state = 'idle' AND (query LIKE 'SELECT r.seq%' OR query LIKE 'WITH ready AS%') AND query_start > $1`, p.checked).Scan(&n)
		if n == 1 {
			break
		}
		if p.err == nil && time.Now().After(deadline) {
			p.err = errors.New("the relay's read ahead was not seen to end within 30 s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	p.take()
	return errs
}

// With KeepSent, a relay stopped while it removes rows kept past the
// window still marks the batch the broker confirmed, whose mark was left
// to go out with the next read: the stop does not cut the removal short,
// which would close the relay's connection first.
func TestRelayStoppedDuringCleanupMarksWhatTheBrokerConfirmed(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	const batch = 5
	pub := &lockAfterReadAhead{Publisher: k.publisher(t), tableLock: newTableLock(pool)}
	// The removal of rows kept past the window waits for the lock.
	stopRelayWhileLocked(t, pool, d, pub, outbox.RelayConfig{BatchSize: batch, KeepSent: time.Hour}, func() bool { return true })

	assert.Equal(t, batch, rows(t, pool, "sent_at IS NOT NULL"), "the confirmed batch is marked sent")
	assert.Equal(t, 3, rows(t, pool, "sent_at IS NULL"), "the rows read ahead wait for the next leader")
}
