package outbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"strconv"
	"strings"
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
	"github.com/onceco/once/internal/pgtemp"
	"github.com/onceco/once/outbox"
)

// Two relay processes run on one outbox while writers add rows and a
// consumer of this library reads the destination; one relay process or the
// other is SIGKILLed at random moments (before, during or after a publish,
// between the broker's confirm and the delete) and started again. At the
// end every row written has exactly one effect downstream, and on Kafka the
// first copies of each key's messages are in the order written.
func TestRelaysKilledAtRandom(t *testing.T) {
	forEachBroker(t, func(t *testing.T, b broker) {
		seed := time.Now().UnixNano()
		rng := rand.New(rand.NewPCG(uint64(seed), 0))
		t.Logf("seed %d", seed)
		pool, schema := migrated(t)
		d := b.destination(t)
		ctx := context.Background()
		_, err := pool.Exec(ctx, `CREATE TABLE effects (event_id text NOT NULL, body text NOT NULL)`)
		require.NoError(t, err)
		effect := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[[]byte]) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, $2)`, ev.ID, string(ev.Payload))
			return err
		}
		c, err := consumer.New(pool, d.source(t, "downstream"), effect, consumer.Config{Name: "downstream", Telemetry: consumer.TelemetryConfig{Logger: testLogger()}})
		require.NoError(t, err)
		run(t, c.Run)

		relays := [2]*exec.Cmd{}
		start := func(i int) {
			relays[i] = childCommand(context.Background(), b, schema, "run")
			require.NoError(t, relays[i].Start())
		}
		kill := func(i int) {
			_ = relays[i].Process.Signal(syscall.SIGKILL)
			_ = relays[i].Wait()
		}
		start(0)
		start(1)
		t.Cleanup(func() { kill(0); kill(1) })

		// Writers write until the last kill; then one relay is left to
		// finish.
		const writers, perTx, kills = 4, 5, 12
		var stopWriting atomic.Bool
		var written atomic.Int64
		var wg sync.WaitGroup
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				next := map[string]int{}
				for !stopWriting.Load() {
					var msgs []outbox.Message
					for j := range perTx {
						key := fmt.Sprintf("w%d-k%d", w, j%3)
						msgs = append(msgs, d.msg(key, fmt.Sprintf("%s/%d", key, next[key])))
						next[key]++
					}
					addCommitted(t, pool, msgs...)
					written.Add(perTx)
					time.Sleep(5 * time.Millisecond) // spreads the writes over the kills
				}
			}()
		}
		for range kills {
			time.Sleep(time.Duration(50+rng.IntN(250)) * time.Millisecond) // the chaos schedule, not a wait for a result
			i := rng.IntN(2)
			kill(i)
			start(i)
		}
		stopWriting.Store(true)
		wg.Wait()
		total := int(written.Load())
		waitRows(t, pool, "true", 0, 60*time.Second)
		require.Eventually(t, func() bool {
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM effects`).Scan(&n))
			return n == total
		}, 60*time.Second, 10*time.Millisecond, "every row reaches the consumer")
		var effects int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&effects))
		assert.Equal(t, total, effects, "one effect per row")
		st := c.Stats()
		t.Logf("%d rows, %d relay kills; downstream: %d handled, %d duplicates skipped", total, kills, st.Handled, st.Duplicates)

		kd, ok := d.(*kafkaDest)
		if !ok {
			return // RabbitMQ: the consumer took the messages; order is not its promise there
		}
		next := map[string]int{}
		for _, m := range firstCopies(kd.read(t, total)) {
			key, n, _ := strings.Cut(m.Body, "/")
			require.Equal(t, strconv.Itoa(next[key]), n, "key %s: first copies in the order written", key)
			next[key]++
		}
	})
}

// PostgreSQL itself is stopped and started again twice while writers write
// (retrying what failed, with the same ids), a relay publishes and a
// consumer of this library reads: the relay reconnects and leads again by
// itself, nothing is lost, and every row written has one effect
// downstream, in order per key on Kafka.
func TestPostgresRestartsMidStream(t *testing.T) {
	k := newKafka(t)
	ctx := context.Background()
	srv, err := pgtemp.Start(ctx, pgtemp.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })
	cfg, err := pgxpool.ParseConfig(srv.URL())
	require.NoError(t, err)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, outbox.Migrate(ctx, pool))
	_, err = pool.Exec(ctx, `CREATE TABLE effects (event_id text NOT NULL, body text NOT NULL)`)
	require.NoError(t, err)

	d := k.destination(t)
	effect := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[[]byte]) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, $2)`, ev.ID, string(ev.Payload))
		return err
	}
	c, err := consumer.New(pool, d.source(t, "downstream"), effect, consumer.Config{Name: "downstream", Telemetry: consumer.TelemetryConfig{Logger: testLogger()},
		InfraBackoff: consumer.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond}})
	require.NoError(t, err)
	run(t, c.Run)
	warns := &atomic.Int64{}
	r, _ := startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 50 * time.Millisecond, BatchSize: 20,
		InfraBackoff: outbox.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond}, Logger: countingLogger(warns)})
	// Run's start (the migration) is not what this test breaks
	// (TestRelayStartedWhileTheDatabaseIsDownWaitsForIt does).
	require.Eventually(t, r.Leader, 30*time.Second, 5*time.Millisecond, "the relay has started and leads")

	const writers, perWriter = 3, 200
	var wg sync.WaitGroup
	var written atomic.Int64
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perWriter {
				key := fmt.Sprintf("w%d", w)
				m := d.msg(key, fmt.Sprintf("%s/%d", key, i))
				m.ID = fmt.Sprintf("%s-%d", key, i) // a retried write keeps its id
				for pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return outbox.Add(ctx, tx, m) }) != nil {
					time.Sleep(20 * time.Millisecond) // the writer's own retry pace while the database is down
				}
				written.Add(1)
			}
		}()
	}
	for restart := range 2 {
		require.Eventually(t, func() bool { return written.Load() > int64((restart+1)*perWriter) }, 60*time.Second,
			5*time.Millisecond, "writes go on between restarts")
		require.NoError(t, srv.Stop(ctx))
		require.NoError(t, srv.Restart(ctx))
		require.Eventually(t, r.Leader, 30*time.Second, 5*time.Millisecond, "the relay leads again after restart %d", restart+1)
	}
	wg.Wait()
	total := writers * perWriter
	require.Eventually(t, func() bool {
		var n int
		return pool.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM effects`).Scan(&n) == nil && n == total
	}, 60*time.Second, 10*time.Millisecond, "every row reaches the consumer")
	var effects int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&effects))
	assert.Equal(t, total, effects, "one effect per event id")
	assert.Positive(t, warns.Load(), "the relay met the restarts")
	next := map[string]int{}
	for _, m := range firstCopies(d.read(t, total)) {
		key, n, _ := strings.Cut(m.Body, "/")
		require.Equal(t, strconv.Itoa(next[key]), n, "key %s: first copies in the order written", key)
		next[key]++
	}
}

// A relay started while PostgreSQL is down (a service restarted during a
// database failover) waits for it, as a consumer does: its migration is
// retried after InfraBackoff and logged, and once the server is back the
// relay creates the table, leads and publishes (was: Run returned the
// connection error at once, and a relay started with `go relay.Run(ctx)`
// beside its consumer never ran).
func TestRelayStartedWhileTheDatabaseIsDownWaitsForIt(t *testing.T) {
	k := newKafka(t)
	ctx := context.Background()
	srv, err := pgtemp.Start(ctx, pgtemp.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })
	pool, err := pgxpool.New(ctx, srv.URL())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, srv.Stop(ctx))

	warns := &atomic.Int64{}
	r, err := outbox.NewRelay(pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond,
		InfraBackoff: outbox.Backoff{Initial: 20 * time.Millisecond, Max: 100 * time.Millisecond}, Logger: countingLogger(warns)})
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	for deadline := time.Now().Add(20 * time.Second); warns.Load() < 3; {
		select {
		case err := <-done:
			t.Fatalf("Run returned while the database was down: %v", err)
		case <-time.After(5 * time.Millisecond):
		}
		require.True(t, time.Now().Before(deadline), "the start is retried and logged")
	}

	require.NoError(t, srv.Restart(ctx))
	require.Eventually(t, r.Leader, 30*time.Second, 5*time.Millisecond, "the relay has created the table and leads")
	d := k.destination(t)
	addCommitted(t, pool, d.msg("a", "a/0"), d.msg("a", "a/1"))
	waitRows(t, pool, "true", 0, 30*time.Second)
	assert.Equal(t, []string{"a/0", "a/1"}, bodies(d.read(t, 2)))
	cancel()
	require.NoError(t, <-done)
}
