package kafka

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// The crash child is this test binary re-executed with crashChildEnv set:
// it consumes the parent's kfake cluster over TCP into the parent's
// database schema and exits with status crashExitCode inside the Ack of
// its crashAt-th delivery, after the delivery's transaction committed and
// before its offset is marked.
const (
	crashChildEnv = "ONCE_KAFKA_CRASH_CHILD"
	crashExitCode = 17
)

type crashChildSpec struct {
	brokers, group, topic, dbURL, schema, name string
	crashAt                                    int64
}

func (s crashChildSpec) env() []string {
	return []string{
		crashChildEnv + "=1",
		"ONCE_KAFKA_CRASH_BROKERS=" + s.brokers,
		"ONCE_KAFKA_CRASH_GROUP=" + s.group,
		"ONCE_KAFKA_CRASH_TOPIC=" + s.topic,
		"ONCE_KAFKA_CRASH_DB=" + s.dbURL,
		"ONCE_KAFKA_CRASH_SCHEMA=" + s.schema,
		"ONCE_KAFKA_CRASH_NAME=" + s.name,
		"ONCE_KAFKA_CRASH_AT=" + strconv.FormatInt(s.crashAt, 10),
	}
}

// runCrashChild is the child's main; it returns the exit status if it does
// not crash.
func runCrashChild() int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "crash child:", err)
		return 2
	}
	crashAt, err := strconv.ParseInt(os.Getenv("ONCE_KAFKA_CRASH_AT"), 10, 64)
	if err != nil {
		return fail(err)
	}
	pc, err := pgxpool.ParseConfig(os.Getenv("ONCE_KAFKA_CRASH_DB"))
	if err != nil {
		return fail(err)
	}
	pc.ConnConfig.RuntimeParams["search_path"] = os.Getenv("ONCE_KAFKA_CRASH_SCHEMA")
	db, err := pgxpool.NewWithConfig(context.Background(), pc)
	if err != nil {
		return fail(err)
	}
	defer db.Close()
	c := &cluster{addrs: strings.Split(os.Getenv("ONCE_KAFKA_CRASH_BROKERS"), ",")}
	src, err := NewSource(c.config(os.Getenv("ONCE_KAFKA_CRASH_GROUP"), os.Getenv("ONCE_KAFKA_CRASH_TOPIC")))
	if err != nil {
		return fail(err)
	}
	// A slow handler, so that periodic commits happen before the crash.
	slow := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
		time.Sleep(10 * time.Millisecond)
		return recordEffect(ctx, tx, ev)
	}
	cons, err := consumer.New(db, &crashingSource{Source: src, crashAt: crashAt},
		slow, consumerConfig(os.Getenv("ONCE_KAFKA_CRASH_NAME")))
	if err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := cons.Run(ctx); err != nil {
		return fail(err)
	}
	return fail(fmt.Errorf("did not crash within a minute"))
}

// crashingSource exits the process in the Ack of its crashAt-th delivery.
type crashingSource struct {
	consumer.Source
	crashAt int64
	acks    atomic.Int64
}

func (s *crashingSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return &crashingDelivery{Delivery: d, src: s}, nil
}

type crashingDelivery struct {
	consumer.Delivery
	src *crashingSource
}

func (d *crashingDelivery) Ack(ctx context.Context) error {
	if d.src.acks.Add(1) == d.src.crashAt {
		// The transaction committed; the offset is not marked.
		fmt.Fprintf(os.Stderr, "crash child: exiting in the ack of %s\n", d.Message().FallbackID)
		os.Exit(crashExitCode)
	}
	return d.Delivery.Ack(ctx)
}

// A process killed between the database commit and the offset mark: the
// restarted consumer gets the committed-but-unmarked records again and the
// dedup claim skips them, so every event's effect is there exactly once.
func TestCrashBetweenCommitAndAck(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 2)
	const n = 60
	c.produceHashed(events(topic, "ev", 0, n))
	db, schema := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)

	spec := crashChildSpec{
		brokers: strings.Join(c.addrs, ","), group: group, topic: topic,
		dbURL: pgtest.URL(), schema: schema, name: "orders-svc", crashAt: 40,
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), spec.env()...)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "child output:\n%s", out)
	require.Equal(t, crashExitCode, exit.ExitCode(), "child output:\n%s", out)

	// The crashing ack was the 40th; the other partition's worker may have
	// committed one more transaction before the process died.
	// The crashing ack was the 40th; the other partition's worker may have
	// committed one more transaction before the process died.
	before := effectCounts(t, db)
	require.GreaterOrEqual(t, len(before), 40)
	require.LessOrEqual(t, len(before), 41)
	for id, k := range before {
		require.Equal(t, 1, k, id)
	}
	// Ack after commit: every record below a committed offset has its
	// effect, and the record whose ack was cut is not below one.
	committed := c.committed(group, topic, 2)
	var redelivered int
	for _, r := range c.readAll(topic) {
		id := string(r.Headers[0].Value)
		if r.Offset < committed[r.Partition] {
			require.Equal(t, 1, before[id], "%s at %d/%d is below the committed offset without its effect", id, r.Partition, r.Offset)
		} else {
			redelivered++
		}
	}
	require.Greater(t, committed[0]+committed[1], int64(0), "the periodic commit ran before the crash: %v", committed)
	require.Greater(t, redelivered, n-len(before), "some handled records were not committed")

	// Restart in this process. The dead member's session (2 s) must expire
	// before the new member gets its partitions.
	src, err := NewSource(c.config(group, topic))
	require.NoError(t, err)
	r := startConsumer(t, db, src, consumerConfig("orders-svc"), recordEffect)
	require.Eventually(t, func() bool {
		st := r.c.Stats()
		return st.Handled+st.Duplicates >= uint64(redelivered)
	}, 60*time.Second, 20*time.Millisecond)
	require.NoError(t, r.stop())
	requireExactlyOnce(t, db, "ev", n)
	st := r.c.Stats()
	assert.Equal(t, uint64(n-len(before)), st.Handled)
	assert.Equal(t, uint64(redelivered-(n-len(before))), st.Duplicates,
		"the handled but uncommitted records, the one whose ack was cut among them, were redelivered and skipped")
	assert.Zero(t, st.DeadLettered)
	assert.Equal(t, map[int32]int64{0: hwm(t, c, topic, 0), 1: hwm(t, c, topic, 1)}, c.committed(group, topic, 2),
		"after a clean stop the committed offsets are the ends of the partitions")
}

// hwm returns the high-water mark of a partition.
func hwm(t testing.TB, c *cluster, topic string, p int32) int64 {
	t.Helper()
	admin, err := sarama.NewClient(c.addrs, saramaConfig())
	require.NoError(t, err)
	defer admin.Close()
	off, err := admin.GetOffset(topic, p, sarama.OffsetNewest)
	require.NoError(t, err)
	return off
}
