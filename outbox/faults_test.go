package outbox_test

import (
	"context"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceco/once/internal/netcut"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/kafkaout"
)

// Two relays run on one table while writers add rows for six keys and the
// leader's database session is killed three times: one relay leads at a
// time (but for the batches a killed leader had in flight and read
// ahead), every row is published, and each key's messages reach the
// broker in the order they were written (re-published copies after a failover
// come after their first copy, so the next hop's deduplication keeps the
// order).
func TestKeyOrderUnderTwoRelays(t *testing.T) {
	forEachBroker(t, func(t *testing.T, b broker) {
		pool, _ := migrated(t)
		d := b.destination(t)
		cfg := outbox.RelayConfig{PollInterval: 20 * time.Millisecond, BatchSize: 16,
			InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}}
		r1, _ := startRelay(t, pool, b.publisher(t), cfg)
		r2, _ := startRelay(t, pool, b.publisher(t), cfg)

		// Who leads, sampled: a killed leader learns it lost its session
		// only when its next statement fails, so for up to two batches two
		// relays may both be publishing; the order check below is what
		// must hold regardless.
		var led1, led2 atomic.Bool
		stopWatch := run(t, func(ctx context.Context) error {
			for ctx.Err() == nil {
				led1.Store(led1.Load() || r1.Leader())
				led2.Store(led2.Load() || r2.Leader())
				time.Sleep(100 * time.Microsecond)
			}
			return nil
		})

		// The writers write at least txs transactions each, and go on until
		// the last kill, so that every leader has new rows to publish.
		const writers, keysPerWriter, txs, perTx = 3, 2, 40, 5
		var wg sync.WaitGroup
		var killed atomic.Bool
		var written atomic.Int64
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				next := map[string]int{}
				for i := 0; i < txs || !killed.Load(); i++ {
					var msgs []outbox.Message
					for j := range perTx {
						key := fmt.Sprintf("w%d-k%d", w, j%keysPerWriter)
						msgs = append(msgs, d.msg(key, fmt.Sprintf("%s/%d", key, next[key])))
						next[key]++
					}
					addCommitted(t, pool, msgs...)
					written.Add(perTx)
				}
			}()
		}
		published := 0
		for range 3 {
			killLeader(t, pool, &published)
		}
		killed.Store(true)
		wg.Wait()
		total := int(written.Load())
		waitRows(t, pool, "true", 0, 60*time.Second)
		stopWatch()
		got := d.read(t, total)

		distinct, _ := ids(got)
		require.Len(t, distinct, total, "every row published")
		firsts := map[string][]int{}
		seen := map[string]bool{}
		for _, m := range got {
			if seen[m.ID] {
				continue
			}
			seen[m.ID] = true
			key, n, _ := strings.Cut(m.Body, "/")
			i, err := strconv.Atoi(n)
			require.NoError(t, err)
			firsts[key] = append(firsts[key], i)
		}
		for key, ns := range firsts {
			for i, n := range ns {
				require.Equal(t, i, n, "key %s: first copies in the order written: %v", key, ns)
			}
		}
		t.Logf("%d messages on the wire for %d rows; relay 1 led: %v, relay 2 led: %v", len(got), total, led1.Load(), led2.Load())
	})
}

// killLeader waits for a leader that has published something since the
// last kill, terminates its database session (which releases the leader
// lock) and returns.
func killLeader(t *testing.T, pool *pgxpool.Pool, published *int) {
	t.Helper()
	ctx := context.Background()
	var pid int32
	require.Eventually(t, func() bool {
		var sent int
		require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(max(seq), 0) - count(*) FROM outbox`).Scan(&sent))
		err := pool.QueryRow(ctx, `SELECT pid FROM pg_locks
WHERE locktype = 'advisory' AND classid = $1::bigint::oid AND objid = 'outbox'::regclass AND objsubid = 2 AND granted`,
			int64(0x6f626f78)).Scan(&pid)
		return err == nil && sent > *published
	}, 30*time.Second, 5*time.Millisecond, "a leader publishes")
	var killed bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, pid).Scan(&killed))
	require.True(t, killed)
	require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(max(seq), 0) - count(*) FROM outbox`).Scan(published))
}

// The broker goes away while rows keep coming, then comes back: the relay
// keeps retrying without charging the rows, and publishes every one once
// the broker is back, in order per key.
func TestBrokerDownThenBack(t *testing.T) {
	t.Run("kafka", func(t *testing.T) {
		k := newKafka(t)
		brokerDownThenBack(t, k.destination(t), k.publisher(t), k.stop, k.start)
	})
	t.Run("rabbitmq", func(t *testing.T) {
		r := rabbitOrSkip(t)
		u, err := url.Parse(r.url)
		require.NoError(t, err)
		proxy, err := netcut.NewProxy(u.Host)
		require.NoError(t, err)
		t.Cleanup(func() { _ = proxy.Close() })
		u.Host = proxy.Addr()
		down := func() {
			proxy.Pause()
			proxy.Cut()
		}
		brokerDownThenBack(t, r.destination(t), r.publisherAt(t, u.String()), down, proxy.Resume)
	})
}

func brokerDownThenBack(t *testing.T, d dest, pub outbox.Publisher, down, up func()) {
	pool, _ := migrated(t)
	warns := &atomic.Int64{}
	startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 1,
		InfraBackoff: outbox.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond},
		Logger:       countingLogger(warns)})
	add := func(from, to int) {
		for i := from; i < to; i++ {
			key := fmt.Sprintf("k%d", i%3)
			addCommitted(t, pool, d.msg(key, fmt.Sprintf("%s/%d", key, i/3)))
		}
	}
	add(0, 30)
	d.read(t, 30)
	waitRows(t, pool, "true", 0, 10*time.Second)

	down()
	before := warns.Load()
	add(30, 60)
	require.Eventually(t, func() bool { return warns.Load() >= before+3 }, 60*time.Second, 10*time.Millisecond,
		"the relay meets the broker down and retries")
	assert.Equal(t, 0, rows(t, pool, "parked_at IS NOT NULL"), "an unreachable broker is not the rows' fault: none parked (MaxAttempts is 1)")
	assert.Equal(t, 0, rows(t, pool, "attempts > 0"), "nor charged")
	up()

	waitRows(t, pool, "true", 0, 60*time.Second)
	got := d.read(t, 60)
	distinct, _ := ids(got)
	require.Len(t, distinct, 60)
	seen := map[string]bool{}
	next := map[string]int{}
	for _, m := range got {
		if seen[m.ID] {
			continue
		}
		seen[m.ID] = true
		key, n, _ := strings.Cut(m.Body, "/")
		require.Equal(t, strconv.Itoa(next[key]), n, "key %s in order", key)
		next[key]++
	}
}

// A broker that never answers a produce request does not hold a stopping
// relay beyond the shutdown grace (5s), nor the publisher's Close after it
// beyond 2s: the unanswered batch stays in the outbox, to be published
// again.
func TestRelayStopsWhileTheBrokerHangs(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	var held atomic.Int64
	k.kf.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		k.kf.KeepControl()
		held.Add(1)
		return nil, nil, true // no answer: the producer waits for its read timeout
	})
	sc := saramaConfig()
	sc.Net.ReadTimeout = time.Minute
	pub, err := kafkaout.New(kafkaout.Config{Brokers: k.addrs, Sarama: sc})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	r, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, Logger: testLogger()})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()

	addCommitted(t, pool, d.msg("a", "a/1"))
	require.Eventually(t, func() bool { return held.Load() > 0 }, 30*time.Second, 5*time.Millisecond, "the relay is publishing")
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("the relay did not stop within 20s while the broker hung (grace 5s, producer read timeout 1m)")
	}
	assert.Equal(t, 1, rows(t, pool, "true"), "the unanswered row stays")
	// Nor does the publisher's Close, which the service calls next, wait
	// for the request in flight (was: until the producer's read timeout).
	closed := make(chan struct{})
	start := time.Now()
	go func() {
		_ = pub.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(20 * time.Second):
		t.Error("the publisher's Close still waited 20s after the relay stopped, the broker hanging")
		k.stop() // ends the request in flight, and Close
		<-closed
	}
	assert.Less(t, time.Since(start), 5*time.Second, "Close waited for the broker that hangs")
}

// The database refuses the delete of a published batch while it still
// answers reads (read-only after a failover, a full disk, a
// statement_timeout): the relay writes that batch's settlement again until
// the database takes it, and publishes nothing meanwhile (was: it read the
// rows again and published them again, after each backoff, for as long as
// the database refused: a copy of the whole batch every few seconds).
func TestRefusedDeleteIsWrittenAgainNotPublishedAgain(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE SEQUENCE refused_deletes;
CREATE TABLE refuse_deletes ();
INSERT INTO refuse_deletes DEFAULT VALUES;
CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM refuse_deletes) THEN
        PERFORM nextval('refused_deletes');
        RAISE EXCEPTION 'cannot execute DELETE in a read-only transaction' USING ERRCODE = 'read_only_sql_transaction';
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER refuse_delete BEFORE DELETE ON outbox FOR EACH STATEMENT EXECUTE FUNCTION refuse_delete()`)
	require.NoError(t, err)
	const n = 5
	var msgs []outbox.Message
	for i := range n {
		msgs = append(msgs, d.msg("k", fmt.Sprint("m", i)))
	}
	addCommitted(t, pool, msgs...)

	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond,
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 20 * time.Millisecond}})
	require.Eventually(t, func() bool {
		var refused int64
		require.NoError(t, pool.QueryRow(ctx, `SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM refused_deletes`).Scan(&refused))
		return refused >= 5
	}, 30*time.Second, 5*time.Millisecond, "the delete refused 5 times")
	_, err = pool.Exec(ctx, `DELETE FROM refuse_deletes`)
	require.NoError(t, err)
	waitRows(t, pool, "true", 0, 30*time.Second)
	got := d.read(t, n)
	assert.Equal(t, n, len(got), "each row published once: %v", bodies(got))
}

// A row the relay has published is locked by another transaction (edited
// by hand, or requeued inside a longer transaction) for longer than the
// relay's bound on writing a settlement: the relay writes that batch's
// settlement again until the lock is gone, and publishes nothing
// meanwhile (was: the client's bound closed the relay's connection, its
// session ended, and the next one read the rows again and published the
// whole batch again, every ten seconds for as long as the lock was held).
func TestRowLockedByAnotherTransactionIsNotPublishedAgain(t *testing.T) {
	k := newKafka(t)
	pool, schema := migrated(t)
	d := k.destination(t)
	ctx := context.Background()
	const n = 5
	var msgs []outbox.Message
	for i := range n {
		msgs = append(msgs, d.msg(fmt.Sprint("k", i%2), fmt.Sprint("m", i)))
	}
	addCommitted(t, pool, msgs...)

	// An edit by hand of the first row, its transaction left open.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `UPDATE outbox SET last_error = 'edited by hand' WHERE seq = (SELECT min(seq) FROM outbox)`)
	require.NoError(t, err)

	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond,
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 20 * time.Millisecond}})
	// The lock is held until the relay's delete of the published batch
	// has waited for it twice (two statements, or two sessions).
	waits := map[string]bool{}
	require.Eventually(t, func() bool {
		rs, err := pool.Query(ctx, `SELECT pid::text || '@' || query_start::text FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query LIKE 'DELETE FROM %' AND pid <> pg_backend_pid()
	AND EXISTS (SELECT FROM pg_locks l WHERE l.pid = pg_stat_activity.pid AND l.relation = to_regclass($1)::oid)`,
			schema+".outbox")
		require.NoError(t, err)
		w, err := pgx.CollectRows(rs, pgx.RowTo[string])
		require.NoError(t, err)
		for _, s := range w {
			waits[s] = true
		}
		return len(waits) >= 2
	}, 60*time.Second, 50*time.Millisecond, "the relay's delete waited for the row lock twice")
	require.NoError(t, tx.Rollback(ctx))

	waitRows(t, pool, "true", 0, 30*time.Second)
	got := d.read(t, n)
	assert.Equal(t, n, len(got), "each row published once: %v", bodies(got))
}

// heldSecondPublisher holds its second Publish call until gate is closed, and
// counts the calls that begin once after is set.
type heldSecondPublisher struct {
	outbox.Publisher
	calls, callsAfter atomic.Int64
	gate              chan struct{}
	after             atomic.Bool
}

func (p *heldSecondPublisher) Publish(ctx context.Context, recs []outbox.Record) []error {
	if p.after.Load() {
		p.callsAfter.Add(1)
	}
	if p.calls.Add(1) == 2 {
		<-p.gate
	}
	return p.Publisher.Publish(ctx, recs)
}

// A leader's session is killed while the broker works on a full batch,
// after the relay read the next batch ahead: once the other relay leads,
// the old leader finishes the batch in flight and publishes the one it
// read ahead too (it learns its session is gone only from the delete it
// sends beside that publish), and nothing more. Every row is published,
// the first copies in order.
func TestKilledLeaderPublishesAtMostTheBatchReadAhead(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	const batch, n = 10, 40
	var msgs []outbox.Message
	for i := range n {
		msgs = append(msgs, d.msg("k", fmt.Sprintf("k/%d", i)))
	}
	addCommitted(t, pool, msgs...)
	cfg := outbox.RelayConfig{PollInterval: 20 * time.Millisecond, BatchSize: batch,
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}}
	pub := &heldSecondPublisher{Publisher: k.publisher(t), gate: make(chan struct{})}
	opened := false
	defer func() {
		if !opened {
			close(pub.gate)
		}
	}()
	r1, _ := startRelay(t, pool, pub, cfg)
	require.Eventually(t, r1.Leader, 30*time.Second, 5*time.Millisecond)
	// The second batch is in flight (held); the first one's delete and
	// the read of the third went out beside it.
	waitRows(t, pool, "true", n-batch, 30*time.Second)
	var pid int32
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT pid FROM pg_locks
WHERE locktype = 'advisory' AND classid = $1::bigint::oid AND objid = 'outbox'::regclass AND objsubid = 2 AND granted`,
		int64(0x6f626f78)).Scan(&pid))
	var killed bool
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT pg_terminate_backend($1)`, pid).Scan(&killed))
	require.True(t, killed)
	r2, _ := startRelay(t, pool, k.publisher(t), cfg)
	require.Eventually(t, r2.Leader, 30*time.Second, 5*time.Millisecond)
	pub.after.Store(true)
	close(pub.gate)
	opened = true

	waitRows(t, pool, "true", 0, 30*time.Second)
	require.Eventually(t, func() bool { return !r1.Leader() }, 30*time.Second, 5*time.Millisecond)
	assert.LessOrEqual(t, pub.callsAfter.Load(), int64(1), "batches the killed leader began after the other one led")
	got := d.read(t, n)
	distinct, _ := ids(got)
	require.Len(t, distinct, n, "every row published")
	seen := map[string]bool{}
	next := 0
	for _, m := range got {
		if seen[m.ID] {
			continue
		}
		seen[m.ID] = true
		require.Equal(t, fmt.Sprintf("k/%d", next), m.Body, "first copies in the order written")
		next++
	}
	t.Logf("%d records on the wire for %d rows; the killed leader began %d batch(es) after the other led", len(got), n, pub.callsAfter.Load())
}
