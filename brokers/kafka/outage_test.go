package kafka

import (
	"context"
	"log/slog"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/kafkatemp"
	"github.com/onceco/once/internal/netcut"
	"github.com/onceco/once/internal/pgtest"
)

// warnCounter is a slog.Handler counting warnings (and passing every record
// to next).
type warnCounter struct {
	next  slog.Handler
	warns *atomic.Int64
}

func (h warnCounter) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= slog.LevelWarn || h.next.Enabled(ctx, l)
}

func (h warnCounter) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		h.warns.Add(1)
	}
	if h.next.Enabled(ctx, r.Level) {
		return h.next.Handle(ctx, r)
	}
	return nil
}

func (h warnCounter) WithAttrs(as []slog.Attr) slog.Handler {
	return warnCounter{next: h.next.WithAttrs(as), warns: h.warns}
}

func (h warnCounter) WithGroup(name string) slog.Handler {
	return warnCounter{next: h.next.WithGroup(name), warns: h.warns}
}

func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	return port
}

// The broker stops while records are in flight and comes back on the same
// port with its data: the consumer notices the outage, reconnects, rejoins
// and resumes from the committed offsets, with every event's effect exactly
// once. kfake is closed and started again on its data directory; Apache
// Kafka is killed with SIGKILL (no controlled shutdown) and restarted.
func TestBrokerRestartResumesWithoutLossOrDoubleEffects(t *testing.T) {
	t.Run(string(kfakeBroker), func(t *testing.T) {
		dir, port := t.TempDir(), freePort(t)
		startBroker := func() *kfake.Cluster {
			kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.Ports(port), kfake.DataDir(dir),
				kfake.GroupMinSessionTimeout(200*time.Millisecond))
			require.NoError(t, err)
			return kf
		}
		kf := startBroker()
		defer func() { kf.Close() }()
		c := &cluster{t: t, kind: kfakeBroker, kf: kf, addrs: kf.ListenAddrs()}
		testBrokerRestart(t, c, func() { kf.Close() }, func() { kf = startBroker(); c.kf = kf })
	})
	t.Run(string(apacheKafka), func(t *testing.T) {
		c := newApacheKafka(t, kafkatemp.Options{})
		testBrokerRestart(t, c, func() { require.NoError(t, c.real.Kill(0)) }, func() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			require.NoError(t, c.real.Restart(ctx, 0))
		})
	})
}

func testBrokerRestart(t *testing.T, c *cluster, stop, restart func()) {
	topic, group := uniq("orders"), uniq("g")
	const partitions, half = 3, 300
	c.createTopic(topic, partitions)
	c.produceHashed(events(topic, "ev", 0, half))

	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	var warns atomicCounter
	cfg := c.config(group, topic)
	cfg.Logger = warns.logger()
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	// From offset 50 of each partition on, handlers wait for the outage:
	// it surely hits records in flight, however fast the first ones went
	// (batches of 10, so the first 50 of each partition commit).
	outage := make(chan struct{})
	slow := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
		if ev.Message.Offset >= 50 {
			select {
			case <-outage:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return recordEffect(ctx, tx, ev)
	}
	ccfg := consumerConfig("orders-svc")
	ccfg.Batch.Size = 10
	r := startConsumer(t, db, src, ccfg, slow)
	waitEffects(t, db, 60, 30*time.Second)

	stop()
	require.Eventually(t, func() bool { return warns.n.Load() > 0 }, 30*time.Second, 10*time.Millisecond,
		"the source notices the outage")
	// Mid-stream by construction: at least 60 effects committed, and
	// none past offset 50 of a partition until the outage ends.
	close(outage)

	restart()
	c.produceHashed(events(topic, "ev", half, half))
	waitEffects(t, db, 2*half, 90*time.Second)
	require.Eventually(t, func() bool {
		st := r.c.Stats()
		return st.Received == st.Handled+st.Duplicates+st.DeadLettered
	}, 30*time.Second, 10*time.Millisecond, "everything received was settled")
	require.NoError(t, r.stop())

	requireExactlyOnce(t, db, "ev", 2*half)
	st := r.c.Stats()
	assert.Equal(t, uint64(2*half), st.Handled, "one committed transaction per event")
	assert.Zero(t, st.DeadLettered, "a broker outage is not poison")
	t.Logf("stats %+v, %d warnings", st, warns.n.Load())
	got := c.committed(group, topic, partitions)
	for p := range int32(partitions) {
		assert.Equal(t, hwm(t, c, topic, p), got[p], "partition %d", p)
	}
}

// Apache Kafka frozen with SIGSTOP for longer than the session timeout
// while records are in flight (a broker that hangs: a long GC pause, a
// stalled disk), then resumed: requests time out, the group's session
// expires at the coordinator, the member rejoins, and every event's effect
// is there exactly once.
func TestBrokerFrozenResumesWithoutLossOrDoubleEffects(t *testing.T) {
	c := newApacheKafka(t, kafkatemp.Options{})
	topic, group := uniq("orders"), uniq("g")
	const partitions, half, n = 3, 300, 600
	c.createTopic(topic, partitions)
	c.produceHashed(events(topic, "ev", 0, half))
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	var warns atomicCounter
	cfg := c.config(group, topic)
	cfg.Logger = warns.logger()
	// Requests to the frozen broker fail after 2 s instead of sarama's 30 s.
	cfg.Sarama.Net.ReadTimeout = 2 * time.Second
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	slow := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
		select {
		case <-time.After(3 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
		return recordEffect(ctx, tx, ev)
	}
	r := startConsumer(t, db, src, consumerConfig("orders-svc"), slow)
	waitEffects(t, db, 100, 30*time.Second)

	require.NoError(t, c.real.Freeze(0))
	frozeAt := time.Now()
	require.Eventually(t, func() bool { return warns.n.Load() > 0 }, 30*time.Second, 10*time.Millisecond,
		"the source notices the hung broker")
	// The fault lasts past the session timeout (2 s), so that the
	// member's session expires at the coordinator once it runs again.
	<-time.After(time.Until(frozeAt.Add(3 * cfg.SessionTimeout / 2)))
	require.NoError(t, c.real.Thaw(0))
	c.produceHashed(events(topic, "ev", half, n-half))

	waitEffects(t, db, n, 90*time.Second)
	require.Eventually(t, func() bool {
		st := r.c.Stats()
		return st.Received == st.Handled+st.Duplicates+st.DeadLettered
	}, 30*time.Second, 10*time.Millisecond, "everything received was settled")
	require.NoError(t, r.stop())
	requireExactlyOnce(t, db, "ev", n)
	st := r.c.Stats()
	assert.Equal(t, uint64(n), st.Handled, "one committed transaction per event")
	assert.Zero(t, st.DeadLettered, "a hung broker is not poison")
	t.Logf("stats %+v, %d warnings", st, warns.n.Load())
	got := c.committed(group, topic, partitions)
	for p := range int32(partitions) {
		assert.Equal(t, hwm(t, c, topic, p), got[p], "partition %d", p)
	}
}

// atomicCounter counts the warnings of the logger it makes.
type atomicCounter struct{ n atomic.Int64 }

func (a *atomicCounter) logger() *slog.Logger {
	return slog.New(warnCounter{next: testLogger().Handler(), warns: &a.n})
}

// Every client connection is cut, twice, while records are in flight:
// fetches, heartbeats and offset commits fail, sarama reconnects, and the
// consumer goes on without loss and without a second effect.
func TestConnectionsCutResumesWithoutLossOrDoubleEffects(t *testing.T) {
	var ln *netcut.Listener
	c := newCluster(t, kfake.ListenFn(func(network, addr string) (net.Listener, error) {
		inner, err := net.Listen(network, addr)
		if err != nil {
			return nil, err
		}
		ln = &netcut.Listener{Listener: inner}
		return ln, nil
	}))
	topic, group := uniq("orders"), uniq("g")
	const partitions, n = 3, 600
	c.createTopic(topic, partitions)
	c.produceHashed(events(topic, "ev", 0, n))
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	var warns atomicCounter
	cfg := c.config(group, topic)
	cfg.Logger = warns.logger()
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	slow := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
		select { // work that takes a while, so that the cuts hit records in flight
		case <-time.After(5 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
		return recordEffect(ctx, tx, ev)
	}
	r := startConsumer(t, db, src, consumerConfig("orders-svc"), slow)

	for _, at := range []int{100, 300} {
		waitEffects(t, db, at, 30*time.Second)
		// Records fetched before a cut keep the handlers busy without a
		// connection; sarama reconnects at its next heartbeat or commit
		// (100 ms here). Cut once connections are open again.
		require.Eventually(t, func() bool { return ln.Cut() > 0 }, 10*time.Second, 5*time.Millisecond,
			"connections were open")
	}
	require.Less(t, len(effectCounts(t, db)), n, "the cuts came mid-stream")
	waitEffects(t, db, n, 60*time.Second)
	require.Eventually(t, func() bool {
		st := r.c.Stats()
		return st.Received == st.Handled+st.Duplicates+st.DeadLettered
	}, 30*time.Second, 10*time.Millisecond, "everything received was settled")
	require.NoError(t, r.stop())

	requireExactlyOnce(t, db, "ev", n)
	st := r.c.Stats()
	assert.Equal(t, uint64(n), st.Handled, "one committed transaction per event")
	assert.Zero(t, st.DeadLettered, "a lost connection is not poison")
	t.Logf("stats %+v, %d warnings", st, warns.n.Load())
	got := c.committed(group, topic, partitions)
	for p := range int32(partitions) {
		assert.Equal(t, hwm(t, c, topic, p), got[p], "partition %d", p)
	}
}
