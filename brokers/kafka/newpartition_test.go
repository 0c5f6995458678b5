package kafka

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// With StartNewest, a partition added to a topic the group already reads
// has no committed offset, like a partition the group never read; it
// started at its end, and the records produced to it before the group
// claimed it were skipped without a word (as Kafka's own consumer does with
// auto.offset.reset=latest). StartNewest is about where a group new to a
// topic starts: a partition with no committed offset while another
// partition of its topic has one was added after the group started, and is
// read from its first record.
func TestStartNewestReadsAPartitionAddedLaterFromItsStart(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		c := newClusterOf(t, kind)
		topic, group := uniq("orders"), uniq("g")
		c.createTopic(topic, 1)
		cfg := c.config(group, topic)
		cfg.InitialOffset = StartNewest

		ackOneAndClose(t, c, c.open(cfg), topic)

		admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
		require.NoError(t, err)
		require.NoError(t, admin.CreatePartitions(topic, 2, nil, false))
		require.NoError(t, admin.Close())
		c.awaitLeaders(topic, 2)
		c.produce(msg(topic, 1, "b")) // to the new partition, before the group claimed it

		b := c.open(cfg)
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		d, err := b.Receive(ctx)
		require.NoError(t, err, "the record produced to the partition added to the topic was skipped")
		assert.Equal(t, "b", string(d.Message().Value))
		assert.Equal(t, int32(1), d.Message().Partition)
		assert.Equal(t, int64(0), d.Message().Offset)
	})
}

// The same while the group runs: its leader notices the partition added
// (Sarama.Metadata.RefreshFrequency, shortened here), the group joins
// again, and the new partition's records produced before that are handled.
// Under the cooperative-sticky strategy the rebalance that adds the
// partition has no Setup to mark its start, and it started at its end: the
// records produced to it before were skipped.
func TestStartNewestReadsAPartitionAddedWhileRunning(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		t.Run("range", func(t *testing.T) { testPartitionAddedWhileRunning(t, kind, nil) })
		t.Run("cooperative-sticky", func(t *testing.T) {
			testPartitionAddedWhileRunning(t, kind, sarama.NewBalanceStrategyCooperativeSticky())
		})
	})
}

func testPartitionAddedWhileRunning(t *testing.T, kind brokerKind, strategy sarama.BalanceStrategy) {
	c := newClusterOf(t, kind)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	db := effectsDB(t)
	cfg := c.config(group, topic)
	cfg.InitialOffset = StartNewest
	cfg.Sarama.Metadata.RefreshFrequency = 500 * time.Millisecond
	if strategy != nil {
		cfg.Sarama.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{strategy}
	}
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	r := startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
	require.Eventually(t, func() bool { return committedOffset(c, group, topic, 0) >= 0 }, 30*time.Second, 20*time.Millisecond)
	c.produceHashed(idless(topic, 0, 3))
	waitEffectsByN(t, db, 3)
	c.addPartitionWithRecords(topic)
	waitEffectsByN(t, db, 8)
	require.NoError(t, r.stop())
	want := map[int]int{0: 1, 1: 1, 2: 1, 100: 1, 101: 1, 102: 1, 103: 1, 104: 1}
	require.Equal(t, want, effectsByN(t, db), "the new partition's records handled once, from its first")
}

// addPartitionWithRecords adds a second partition to topic, of one
// partition, and produces five records to it, n 100 to 104.
func (c *cluster) addPartitionWithRecords(topic string) {
	c.t.Helper()
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(c.t, err)
	require.NoError(c.t, admin.CreatePartitions(topic, 2, nil, false))
	require.NoError(c.t, admin.Close())
	c.awaitLeaders(topic, 2)
	for i := range 5 {
		c.produce(msg(topic, 1, fmt.Sprintf(`{"n":%d}`, 100+i)))
	}
}

// The same with OffsetsInDatabase, where the group's committed offsets
// are not where a partition starts: a partition added to the topic, while
// the consumer runs or while it is stopped, has no position in the table
// and is read from its first record, each record once.
func TestOffsetsInDatabaseStartNewestReadsAPartitionAdded(t *testing.T) {
	for _, whileStopped := range []bool{false, true} {
		t.Run(map[bool]string{false: "while running", true: "while stopped"}[whileStopped], func(t *testing.T) {
			c := newCluster(t)
			topic, group := uniq("orders"), uniq("g")
			c.createTopic(topic, 1)
			db := effectsDB(t)
			cfg := c.dbOffsetsConfig(group, topic)
			cfg.InitialOffset = StartNewest
			cfg.Sarama.Metadata.RefreshFrequency = 500 * time.Millisecond
			open := func() *runningConsumer {
				src, err := Open(t.Context(), cfg)
				require.NoError(t, err)
				return startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
			}
			r := open()
			probeUntilClaimed(t, c, db, topic)
			if whileStopped {
				require.NoError(t, r.stop())
			}
			c.addPartitionWithRecords(topic)
			if whileStopped {
				r = open()
			}
			added := func() map[int]int { return effectsBeforeProbes(t, db) }
			want := map[int]int{100: 1, 101: 1, 102: 1, 103: 1, 104: 1}
			require.Eventually(t, func() bool { return len(added()) == len(want) }, 30*time.Second, 20*time.Millisecond,
				"the added partition's records: %v", added())
			require.NoError(t, r.stop())
			assert.Equal(t, want, added(), "each record of the added partition handled once")
		})
	}
}

// A group new to a topic, under StartNewest, starts each partition at its
// end and marks that start in Setup, so that a record produced later is
// read by the partition's next owner. The mark was committed only by the
// first periodic commit (CommitInterval): a member that crashed before it,
// having handled some records and not others, left no committed offset,
// and the next member started at the end again, past the records the
// first had not handled. Setup commits the starts it marks.
func TestStartNewestStartSurvivesACrashBeforeTheFirstCommit(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	db, schema := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	spec := crashChildSpec{
		brokers: strings.Join(c.addrs, ","), group: group, topic: topic,
		dbURL: pgtest.URL(), schema: schema, name: "svc", crashOnN: 10,
		newest: true, commitInterval: time.Hour, // no periodic commit before the crash
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), spec.env()...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	probeUntilClaimed(t, c, db, topic)
	for i := range 20 {
		c.produce(msg(topic, 0, fmt.Sprintf(`{"n":%d}`, i)))
	}
	select {
	case err := <-exited:
		var exit *exec.ExitError
		require.ErrorAs(t, err, &exit, "child output:\n%s", &out)
		require.Equal(t, crashExitCode, exit.ExitCode(), "child output:\n%s", &out)
	case <-time.After(time.Minute):
		t.Fatalf("the child did not crash; output:\n%s", &out)
	}

	cfg := c.config(group, topic)
	cfg.InitialOffset = StartNewest
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	r := startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
	events := func() map[int]int { return effectsBeforeProbes(t, db) }
	require.Eventually(t, func() bool { return len(events()) == 20 }, 30*time.Second, 20*time.Millisecond,
		"the records after the crash are read from the start the first member marked: %v", events())
	require.NoError(t, r.stop())
	for n, k := range events() {
		assert.Equal(t, 1, k, "event %d", n)
	}
}

// firstProbe is the n of the first record probeUntilClaimed produces: the
// tests' own events are numbered below it.
const firstProbe = 1000

// probeUntilClaimed produces records numbered from firstProbe to
// partition 0 of topic until one has its effect in db: under StartNewest
// a record counts only once a member claimed the partition, and that
// member's start is then marked.
func probeUntilClaimed(t *testing.T, c *cluster, db *pgxpool.Pool, topic string) {
	t.Helper()
	n := firstProbe
	require.Eventually(t, func() bool {
		c.produce(msg(topic, 0, fmt.Sprintf(`{"n":%d}`, n)))
		n++
		return len(effectsByN(t, db)) > 0
	}, 30*time.Second, 200*time.Millisecond, "no probe record handled")
}

// effectsBeforeProbes is effectsByN without the probes' effects.
func effectsBeforeProbes(t *testing.T, db *pgxpool.Pool) map[int]int {
	t.Helper()
	got := effectsByN(t, db)
	for n := range got {
		if n >= firstProbe {
			delete(got, n)
		}
	}
	return got
}

// With OffsetsInDatabase the table keeps the group's positions when Kafka
// forgets the group's offsets (offsets.retention.minutes, the group
// deleted or renamed), which is what the option is for. A partition added
// to the topic meanwhile has a position in neither: Setup asked Kafka
// alone whether the group reads the topic, took the group for one new to
// it, and started the partition at its end, so that the records produced
// to it while the group was away were never handled, without a word. The
// table's positions of the topic's other partitions say that the group
// reads the topic: the added partition is read from its first record, and
// the old partition from its position, each record once.
func TestOffsetsInDatabaseStartNewestReadsAPartitionAddedWhileKafkaForgotTheGroup(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		c := newClusterOf(t, kind)
		topic, group := uniq("orders"), uniq("g")
		c.createTopic(topic, 1)
		db := effectsDB(t)
		cfg := c.dbOffsetsConfig(group, topic)
		cfg.InitialOffset = StartNewest
		open := func() *runningConsumer {
			src, err := Open(t.Context(), cfg)
			require.NoError(t, err)
			return startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
		}
		r := open()
		probeUntilClaimed(t, c, db, topic)
		require.NoError(t, r.stop())

		admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
		require.NoError(t, err)
		require.NoError(t, admin.DeleteConsumerGroup(group))
		require.NoError(t, admin.Close())
		c.addPartitionWithRecords(topic)
		c.produce(msg(topic, 0, `{"n":200}`)) // to the old partition while the group was away

		r = open()
		events := func() map[int]int { return effectsBeforeProbes(t, db) }
		want := map[int]int{100: 1, 101: 1, 102: 1, 103: 1, 104: 1, 200: 1}
		assert.Eventually(t, func() bool { return len(events()) == len(want) }, 30*time.Second, 20*time.Millisecond,
			"the records produced while Kafka had forgotten the group")
		require.NoError(t, r.stop())
		assert.Equal(t, want, events(), "each record produced while the group was away handled once")
	})
}

// A position the offsets table records shows the group reading its topic
// unless Kafka's committed offset beside it is a start marked in the
// session's own generation: members of a group new to the topic record
// those starts in the table as they set up their claims together, and a
// member slower than another would otherwise read its partitions from
// their first records.
func TestReadInDatabaseLeavesOutStartsOfTheSessionsGeneration(t *testing.T) {
	const gen = 7
	positioned := map[topicPartition]bool{{"orders", 0}: true}
	answer := func(offset int64, metadata string) *sarama.OffsetFetchResponse {
		resp := &sarama.OffsetFetchResponse{}
		resp.AddBlock("orders", 0, &sarama.OffsetFetchResponseBlock{Offset: offset, Metadata: metadata, Err: sarama.ErrNoError})
		resp.AddBlock("orders", 1, &sarama.OffsetFetchResponseBlock{Offset: -1, Err: sarama.ErrNoError})
		return resp
	}
	assert.False(t, readInDatabase(answer(5, startMetadata(gen)), "orders", gen, positioned), "a start of this generation's")
	assert.True(t, readInDatabase(answer(-1, ""), "orders", gen, positioned), "Kafka forgot the group's offsets")
	assert.True(t, readInDatabase(answer(5, ""), "orders", gen, positioned), "an acked record's offset")
	assert.True(t, readInDatabase(answer(5, startMetadata(gen-1)), "orders", gen, positioned), "a start of an earlier generation's")
	assert.False(t, readInDatabase(answer(-1, ""), "payments", gen, positioned), "another topic's position")
	assert.False(t, readInDatabase(answer(-1, ""), "orders", gen, nil), "no position in the table")
}
