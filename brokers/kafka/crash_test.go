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
// it consumes the parent's cluster (kfake or Apache Kafka) over TCP into the parent's
// database schema and exits with status crashExitCode inside the Ack of
// its crashAt-th delivery, after the delivery's transaction committed and
// before its offset is marked.
const (
	crashChildEnv = "ONCE_KAFKA_CRASH_CHILD"
	crashExitCode = 17
)

type crashChildSpec struct {
	brokers, group, topic, dbURL, schema, name string
	// crashAt > 0: exit in the Ack of the crashAt-th delivery.
	crashAt int64
	// crashOnID != "": exit inside the handler of that event, before its
	// transaction commits; exit 0 once settled messages reach settle.
	crashOnID string
	settle    int
	// offsetsInDB and lanes set Config.OffsetsInDatabase and
	// Config.KeyLanes; crashOnN > 0: exit inside the handler of the event
	// with that number once afterEffects effects are committed.
	offsetsInDB            bool
	lanes                  int
	crashOnN, afterEffects int
	// newest sets Config.InitialOffset StartNewest; commitInterval, when
	// set, Config.CommitInterval.
	newest         bool
	commitInterval time.Duration
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
		"ONCE_KAFKA_CRASH_ON_ID=" + s.crashOnID,
		"ONCE_KAFKA_CRASH_SETTLE=" + strconv.Itoa(s.settle),
		"ONCE_KAFKA_CRASH_DB_OFFSETS=" + strconv.FormatBool(s.offsetsInDB),
		"ONCE_KAFKA_CRASH_LANES=" + strconv.Itoa(s.lanes),
		"ONCE_KAFKA_CRASH_AFTER_EFFECTS=" + strconv.Itoa(s.afterEffects),
		"ONCE_KAFKA_CRASH_ON_N=" + map[bool]string{true: strconv.Itoa(s.crashOnN), false: ""}[s.crashOnN > 0],
		"ONCE_KAFKA_CRASH_NEWEST=" + strconv.FormatBool(s.newest),
		"ONCE_KAFKA_CRASH_COMMIT_INTERVAL=" + s.commitInterval.String(),
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
	scfg := c.config(os.Getenv("ONCE_KAFKA_CRASH_GROUP"), os.Getenv("ONCE_KAFKA_CRASH_TOPIC"))
	scfg.OffsetsInDatabase = os.Getenv("ONCE_KAFKA_CRASH_DB_OFFSETS") == "true"
	scfg.KeyLanes, _ = strconv.Atoi(os.Getenv("ONCE_KAFKA_CRASH_LANES"))
	if os.Getenv("ONCE_KAFKA_CRASH_NEWEST") == "true" {
		scfg.InitialOffset = StartNewest
	}
	if d, err := time.ParseDuration(os.Getenv("ONCE_KAFKA_CRASH_COMMIT_INTERVAL")); err == nil && d > 0 {
		scfg.CommitInterval = d
	}
	crashOnN, err := strconv.Atoi(os.Getenv("ONCE_KAFKA_CRASH_ON_N"))
	if err != nil {
		crashOnN = -1
	}
	afterEffects, _ := strconv.Atoi(os.Getenv("ONCE_KAFKA_CRASH_AFTER_EFFECTS"))
	src, err := Open(context.Background(), scfg)
	if err != nil {
		return fail(err)
	}
	crashOnID := os.Getenv("ONCE_KAFKA_CRASH_ON_ID")
	settle, _ := strconv.Atoi(os.Getenv("ONCE_KAFKA_CRASH_SETTLE"))
	// A slow handler, so that periodic commits happen before the crash.
	slow := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
		time.Sleep(10 * time.Millisecond)
		if err := recordEffect(ctx, tx, ev); err != nil {
			return err
		}
		if ev.ID == crashOnID {
			fmt.Fprintf(os.Stderr, "crash child: exiting in the handler of %s\n", ev.ID)
			os.Exit(crashExitCode)
		}
		if crashOnN >= 0 && ev.Payload.N == crashOnN {
			awaitCommittedEffects(db, afterEffects)
			fmt.Fprintf(os.Stderr, "crash child: exiting in the handler of event %d\n", crashOnN)
			os.Exit(crashExitCode)
		}
		return nil
	}
	cfg := consumerConfig(os.Getenv("ONCE_KAFKA_CRASH_NAME"))
	cfg.CrashGuard.MaxCrashes = 2
	// Batches of at most 10 slow events: acks come 100 ms apart per
	// partition, interleaved with the periodic commits.
	cfg.Batch.Size = 10
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	if err != nil {
		return fail(err)
	}
	defer admin.Close()
	group := os.Getenv("ONCE_KAFKA_CRASH_GROUP")
	committed := func() bool {
		resp, err := admin.ListConsumerGroupOffsets(group, nil)
		if err != nil {
			return false
		}
		for _, blocks := range resp.Blocks {
			for _, b := range blocks {
				if b.Err == sarama.ErrNoError && b.Offset > 0 {
					return true
				}
			}
		}
		return false
	}
	cons, err := consumer.New(db, &crashingSource{Source: src, crashAt: crashAt, committed: committed}, slow, cfg)
	if err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- cons.Run(ctx) }()
	if settle > 0 {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for range tick.C {
			st := cons.Stats()
			if st.Handled+st.Duplicates+st.DeadLettered >= uint64(settle) || ctx.Err() != nil {
				break
			}
		}
		cancel()
		if err := <-done; err != nil {
			return fail(err)
		}
		fmt.Fprintf(os.Stderr, "crash child: settled %+v\n", cons.Stats())
		return 0
	}
	if err := <-done; err != nil {
		return fail(err)
	}
	return fail(fmt.Errorf("did not crash within a minute"))
}

// crashingSource exits the process in the Ack of its crashAt-th delivery,
// or of the first one after it once the group has committed an offset: a
// crash before any periodic commit would leave nothing below a committed
// offset to check.
type crashingSource struct {
	consumer.Source
	crashAt   int64
	committed func() bool
	acks      atomic.Int64
}

func (s *crashingSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return &crashingDelivery{Delivery: d, src: s}, nil
}

// BindProgress and RecordProgress are the wrapped Source's, so that it
// keeps its offsets in the database.
func (s *crashingSource) BindProgress(ctx context.Context, b consumer.ProgressBinding) error {
	if r, ok := s.Source.(consumer.ProgressRecorder); ok {
		return r.BindProgress(ctx, b)
	}
	return nil
}

func (s *crashingSource) RecordProgress(ctx context.Context, tx pgx.Tx, ds []consumer.Delivery) error {
	if r, ok := s.Source.(consumer.ProgressRecorder); ok {
		return r.RecordProgress(ctx, tx, ds)
	}
	return nil
}

type crashingDelivery struct {
	consumer.Delivery
	src *crashingSource
}

// Unwrap returns the Source's delivery (kafka's RecordProgress finds it).
func (d *crashingDelivery) Unwrap() consumer.Delivery { return d.Delivery }

// DeduplicatedByPosition is the wrapped delivery's.
func (d *crashingDelivery) DeduplicatedByPosition() bool {
	pd, ok := d.Delivery.(consumer.PositionDeduplicated)
	return ok && pd.DeduplicatedByPosition()
}

// awaitCommittedEffects returns once n effects are committed, or after a
// minute.
func awaitCommittedEffects(db *pgxpool.Pool, n int) {
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		var got int
		if db.QueryRow(context.Background(), `SELECT count(*) FROM effects`).Scan(&got) == nil && got >= n {
			return
		}
		time.Sleep(5 * time.Millisecond) // polling the condition
	}
}

func (d *crashingDelivery) Ack(ctx context.Context) error {
	if n := d.src.acks.Add(1); d.src.crashAt > 0 && n >= d.src.crashAt && d.src.committed() {
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
	eachBroker(t, testCrashBetweenCommitAndAck)
}

func testCrashBetweenCommitAndAck(t *testing.T, kind brokerKind) {
	c := newClusterOf(t, kind)
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

	// The crashing ack was the 40th or a later one: at least 40
	// transactions committed, and more where batches committed ahead of
	// their acks.
	before := effectCounts(t, db)
	require.GreaterOrEqual(t, len(before), 40)
	require.LessOrEqual(t, len(before), n)
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
	require.True(t, committed[0] > 0 || committed[1] > 0, "the periodic commit ran before the crash: %v", committed)
	require.Greater(t, redelivered, n-len(before), "some handled records were not committed")

	// Restart in this process. The dead member's session (2 s) must expire
	// before the new member gets its partitions.
	src, err := Open(t.Context(), c.config(group, topic))
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

// A record that kills the process inside its handler every time is
// dead-lettered with kind crash-loop after CrashGuard.MaxCrashes restarts, even
// though Kafka keeps no delivery count: the core sees each restart's new
// partition claim as a new assignment (a new Delivery.Context) and counts
// durable attempts for its first new record. The other events' effects are
// there exactly once.
func TestCrashLoopRecordDeadLettered(t *testing.T) {
	eachBroker(t, testCrashLoopRecordDeadLettered)
}

func testCrashLoopRecordDeadLettered(t *testing.T, kind brokerKind) {
	c := newClusterOf(t, kind)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 1)
	const n = 10
	c.produceHashed(events(topic, "ev", 0, n))
	db, schema := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)

	spec := crashChildSpec{
		brokers: strings.Join(c.addrs, ","), group: group, topic: topic,
		dbURL: pgtest.URL(), schema: schema, name: "orders-svc", crashOnID: "ev-3", settle: n,
	}
	crashes := 0
	for run := 1; ; run++ {
		require.LessOrEqual(t, run, 5, "the crash loop did not end")
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), spec.env()...)
		out, err := cmd.CombinedOutput()
		if err == nil {
			t.Logf("run %d settled: %s", run, strings.TrimSpace(string(out)))
			break
		}
		var exit *exec.ExitError
		require.ErrorAs(t, err, &exit, "child output:\n%s", out)
		require.Equal(t, crashExitCode, exit.ExitCode(), "child output:\n%s", out)
		crashes++
	}
	// The first run may crash before ev-3 counts as suspect; after that,
	// every crash is counted, and the third count dead-letters it.
	assert.GreaterOrEqual(t, crashes, 2)
	assert.LessOrEqual(t, crashes, 3)

	want := map[string]int{}
	for i := range n {
		if i != 3 {
			want["ev-"+strconv.Itoa(i)] = 1
		}
	}
	assert.Equal(t, want, effectCounts(t, db), "the crashing event's transaction never committed; the others once")
	dl := c.readAll(topic + ".dlq")
	require.Len(t, dl, 1)
	h := map[string]string{}
	for _, rh := range dl[0].Headers {
		h[string(rh.Key)] = string(rh.Value)
	}
	assert.Equal(t, string(consumer.KindCrashLoop), h[consumer.HeaderErrorKind])
	assert.Equal(t, "ev-3", h[consumer.HeaderEventID])
	assert.Equal(t, "3", h[consumer.HeaderOriginalOffset])
	assert.Equal(t, map[int32]int64{0: n}, c.committed(group, topic, 1))
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
