package kafka

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
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
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// mixedEvents returns records n = from..from+count-1 spread over partitions
// by key: the even ones carry an id ("ev-n"), the odd ones none (their id
// is the adapter's position-based fallback).
func mixedEvents(topic string, from, count int) []*sarama.ProducerMessage {
	out := make([]*sarama.ProducerMessage, 0, count)
	for i := from; i < from+count; i++ {
		v, _ := json.Marshal(event{N: i})
		m := &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(fmt.Sprintf("key-%d", i%16)), Value: sarama.ByteEncoder(v)}
		if i%2 == 0 {
			m.Headers = []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(fmt.Sprintf("ev-%d", i))}}
		}
		out = append(out, m)
	}
	return out
}

// effectsByN returns the number of business rows per event number.
func effectsByN(t testing.TB, db *pgxpool.Pool) map[int]int {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT n, count(*) FROM effects GROUP BY n`)
	require.NoError(t, err)
	got := map[int]int{}
	var n, k int
	_, err = pgx.ForEachRow(rows, []any{&n, &k}, func() error { got[n] = k; return nil })
	require.NoError(t, err)
	return got
}

// requireEachOnce asserts one business row for each event 0..n-1 and
// nothing else.
func requireEachOnce(t testing.TB, db *pgxpool.Pool, n int) {
	t.Helper()
	want := make(map[int]int, n)
	for i := range n {
		want[i] = 1
	}
	require.Equal(t, want, effectsByN(t, db), "each event's effect exactly once, nothing lost")
}

// waitEffectsByN waits until n distinct events have their business row.
func waitEffectsByN(t testing.TB, db *pgxpool.Pool, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return len(effectsByN(t, db)) >= n }, 60*time.Second, 20*time.Millisecond,
		"want the effects of %d events", n)
}

// dbOffsetsConfig is a test Source configuration with
// Config.OffsetsInDatabase.
func (c *cluster) dbOffsetsConfig(group, topic string) Config {
	cfg := c.config(group, topic)
	cfg.OffsetsInDatabase = true
	return cfg
}

// runToEnd runs a consumer named "svc" with OffsetsInDatabase on group
// until the effects of want events are there, stops it and returns its
// stats and the source's count of records skipped as recorded done.
func runToEnd(t *testing.T, c *cluster, db *pgxpool.Pool, cfg Config, ccfg consumer.Config, want int) (consumer.Stats, int64) {
	t.Helper()
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	r := startConsumer(t, db, src, ccfg, recordEffect)
	waitEffectsByN(t, db, want)
	require.NoError(t, r.stop())
	return r.c.Stats(), src.skippedRecords()
}

// processedRows counts the consumer's rows in processed_events.
func processedRows(t testing.TB, db *pgxpool.Pool) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(context.Background(), `SELECT count(*) FROM processed_events WHERE consumer = 'svc'`).Scan(&n))
	return n
}

// offsetsRows returns the offsets table's next_offset per partition of
// topic.
func offsetsRows(t testing.TB, db *pgxpool.Pool, topic string) map[int32]int64 {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT partition, next_offset FROM processed_events_offsets WHERE consumer = 'svc' AND topic = $1`, topic)
	require.NoError(t, err)
	got := map[int32]int64{}
	var p int32
	var next int64
	_, err = pgx.ForEachRow(rows, []any{&p, &next}, func() error { got[p] = next; return nil })
	require.NoError(t, err)
	return got
}

// The group's offsets are lost while the consumer is stopped (the group
// deleted, as offsets.retention.minutes or an operator would, and joined
// again from Config.InitialOffset: the topic's start), and retention has
// removed every processed-events row: the restarted consumer resumes where
// the database says, handles the new records once, and handles no old one
// again. Records without ids never had a processed-events row.
func TestOffsetsInDatabaseSurviveLostGroupOffsets(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		c := newClusterOf(t, kind)
		topic, group := uniq("orders"), uniq("g")
		c.createTopic(topic, 2)
		db, _ := pgtest.Schema(t)
		_, err := db.Exec(context.Background(), effectsTable)
		require.NoError(t, err)

		const first, later = 40, 10
		c.produceHashed(mixedEvents(topic, 0, first))
		st, _ := runToEnd(t, c, db, c.dbOffsetsConfig(group, topic), consumerConfig("svc"), first)
		assert.Equal(t, uint64(first), st.Handled)
		assert.Equal(t, first/2, processedRows(t, db), "only the records with ids have processed-events rows")
		assert.Equal(t, map[int32]int64{0: hwm(t, c, topic, 0), 1: hwm(t, c, topic, 1)}, offsetsRows(t, db, topic),
			"the table's positions are the ends of the partitions")

		// Retention removes every processed-events row; the group is
		// deleted with its offsets.
		store, err := dedup.New(dedup.Config{})
		require.NoError(t, err)
		removed, err := store.DeleteOlderThan(context.Background(), db, "svc", time.Now().Add(time.Hour), 1000)
		require.NoError(t, err)
		assert.Equal(t, int64(first/2), removed)
		admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
		require.NoError(t, err)
		require.NoError(t, admin.DeleteConsumerGroup(group))
		groups, err := admin.ListConsumerGroups()
		require.NoError(t, err)
		require.NotContains(t, groups, group, "the group and its offsets are gone")
		require.NoError(t, admin.Close())

		c.produceHashed(mixedEvents(topic, first, later))
		st, skipped := runToEnd(t, c, db, c.dbOffsetsConfig(group, topic), consumerConfig("svc"), first+later)
		requireEachOnce(t, db, first+later)
		assert.Equal(t, uint64(later), st.Handled, "only the new records were handled")
		assert.Zero(t, st.Duplicates, "no old record was even delivered: the partitions were sought to the table's positions")
		assert.Zero(t, skipped)
		assert.Equal(t, map[int32]int64{0: hwm(t, c, topic, 0), 1: hwm(t, c, topic, 1)}, c.committed(group, topic, 2),
			"offsets are committed to Kafka too, after the database")
	})
}

// tablesOfState are the tables a database restore puts back: the
// business table and the consumer's.
var tablesOfState = []string{"effects", "processed_events", "processed_events_attempts", "processed_events_offsets"}

// The database is restored from a backup taken earlier while Kafka keeps
// the group's offsets: the consumer handles again exactly the records after
// the backup, whose effects the restore took away, and the business table
// ends exact.
func TestOffsetsInDatabaseDatabaseRestored(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 2)
	db, _ := pgtest.Schema(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, effectsTable)
	require.NoError(t, err)

	const before, after = 30, 20
	c.produceHashed(mixedEvents(topic, 0, before))
	runToEnd(t, c, db, c.dbOffsetsConfig(group, topic), consumerConfig("svc"), before)
	for _, table := range tablesOfState {
		_, err := db.Exec(ctx, `CREATE TABLE backup_`+table+` AS SELECT * FROM `+table)
		require.NoError(t, err)
	}

	c.produceHashed(mixedEvents(topic, before, after))
	runToEnd(t, c, db, c.dbOffsetsConfig(group, topic), consumerConfig("svc"), before+after)
	committed := c.committed(group, topic, 2)
	assert.Equal(t, map[int32]int64{0: hwm(t, c, topic, 0), 1: hwm(t, c, topic, 1)}, committed)

	for _, table := range tablesOfState {
		_, err := db.Exec(ctx, `DELETE FROM `+table+`; INSERT INTO `+table+` SELECT * FROM backup_`+table)
		require.NoError(t, err)
	}
	require.Len(t, effectsByN(t, db), before, "the restore took the later effects away")

	st, skipped := runToEnd(t, c, db, c.dbOffsetsConfig(group, topic), consumerConfig("svc"), before+after)
	requireEachOnce(t, db, before+after)
	assert.Equal(t, uint64(after), st.Handled, "exactly the records after the backup were handled again")
	assert.Zero(t, st.Duplicates)
	assert.Zero(t, skipped)
}

// With key lanes and one slow key, the records of the other keys commit
// ahead of the slow one; the consumer stops with the slow record unsettled
// (its transaction rolled back), as a crash would leave it. The table
// records what is done above the slow record, so the restarted consumer
// handles the slow key's records and skips the others (acked without
// running the handler): every effect once.
func TestOffsetsInDatabaseKeyLanesStopWithSlowKey(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		c := newClusterOf(t, kind)
		topic, group := uniq("orders"), uniq("g")
		c.createTopic(topic, 1)
		db, _ := pgtest.Schema(t)
		_, err := db.Exec(context.Background(), effectsTable)
		require.NoError(t, err)

		const lanes, others = 4, 30
		// Record 0 has the slow key; then the slow key again at 10 and
		// 20, the others' keys between; no record carries an id.
		slowKey := "slow"
		keys := keysOffLane(slowKey, lanes, 5)
		var msgs []*sarama.ProducerMessage
		slowN := map[int]bool{}
		for i := range others + 1 {
			key := keys[i%len(keys)]
			if i%10 == 0 {
				key, slowN[i] = slowKey, true
			}
			v, _ := json.Marshal(event{N: i})
			msgs = append(msgs, &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(key), Value: sarama.ByteEncoder(v)})
		}
		c.produceHashed(msgs)

		cfg := c.dbOffsetsConfig(group, topic)
		cfg.KeyLanes = lanes
		src, err := Open(t.Context(), cfg)
		require.NoError(t, err)
		ccfg := consumerConfig("svc")
		ccfg.HandlerTimeout = time.Minute
		// The slow handler outlives the stop: the shutdown deadline cuts
		// its transaction short, as a crash would.
		ccfg.ShutdownTimeout = 500 * time.Millisecond
		entered := make(chan struct{}, 1)
		r := startConsumer(t, db, src, ccfg, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
			if slowN[ev.Payload.N] {
				select {
				case entered <- struct{}{}:
				default:
				}
				<-ctx.Done() // the slow key never finishes in this run
				return ctx.Err()
			}
			return recordEffect(ctx, tx, ev)
		})
		<-entered
		waitEffectsByN(t, db, others+1-len(slowN))
		require.NoError(t, r.stop())
		assert.Equal(t, map[int32]int64{0: 0}, offsetsRows(t, db, topic), "the table's prefix stops at the slow record")
		var done []int64
		require.NoError(t, db.QueryRow(context.Background(), `SELECT done FROM processed_events_offsets WHERE topic = $1`, topic).Scan(&done))
		assert.Len(t, done, others+1-len(slowN), "the records done above it are recorded")
		assert.Zero(t, processedRows(t, db), "records without ids need no processed-events row")

		cfg = c.dbOffsetsConfig(group, topic)
		cfg.KeyLanes = lanes
		st, skipped := runToEnd(t, c, db, cfg, consumerConfig("svc"), others+1)
		requireEachOnce(t, db, others+1)
		assert.Equal(t, uint64(len(slowN)), st.Handled, "the slow key's records were handled")
		assert.Equal(t, int64(others+1-len(slowN)), skipped, "the records done above the slow one were skipped")
		assert.Equal(t, map[int32]int64{0: others + 1}, offsetsRows(t, db, topic))
	})
}

// A member whose partition is taken over while its transaction is in
// flight cannot record progress after the new owner did. Member A handles
// a record, then its handler holds the transaction of the next, which has
// no id (nothing but the offsets row stands between two owners handling
// it); member B, with the same consumer name under a re-created group,
// takes the partition over, handles the held record and commits. A's
// handler is then released: its transaction is fenced, rolled back and its
// record abandoned (not acked, not dead-lettered, not retried). The held
// record's effect is there once.
func TestOffsetsInDatabaseFencesPreviousOwner(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	// n = 1 and n = 3: no ids.
	c.produceHashed(append(mixedEvents(topic, 1, 1), mixedEvents(topic, 3, 1)...))

	entered, release := make(chan struct{}), make(chan struct{})
	var abandoned atomic.Int32
	accfg := consumerConfig("svc")
	accfg.HandlerTimeout = time.Minute
	// One message per transaction, so that the crash guard's window (the
	// first batch of an assignment) holds only the first record: the
	// held one is handled on the steady path, without a crash-guard row
	// that would make B wait for A's transaction.
	accfg.Batch.Size = 1
	accfg.Hooks.OnOutcome = func(_ context.Context, o consumer.Outcome) {
		if o.Result == consumer.ResultAbandoned {
			abandoned.Add(1)
		}
	}
	srcA, err := Open(t.Context(), c.dbOffsetsConfig(uniq("g"), topic))
	require.NoError(t, err)
	a := startConsumer(t, db, srcA, accfg, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
		if ev.Payload.N == 3 {
			close(entered)
			<-release // ignores ctx: it outlives the take-over
		}
		return recordEffect(ctx, tx, ev)
	})
	<-entered
	require.Equal(t, map[int32]int64{0: 1}, offsetsRows(t, db, topic), "A recorded its first record")

	st, _ := runToEnd(t, c, db, c.dbOffsetsConfig(uniq("g"), topic), consumerConfig("svc"), 2)
	assert.Equal(t, uint64(1), st.Handled, "the new owner handled the held record, and not the first")
	assert.Equal(t, map[int32]int64{0: 2}, offsetsRows(t, db, topic))

	close(release)
	require.Eventually(t, func() bool { return abandoned.Load() == 1 }, 30*time.Second, 10*time.Millisecond,
		"the old owner's transaction was fenced and its record abandoned")
	ast := a.c.Stats()
	require.NoError(t, a.stop())
	assert.Equal(t, map[int]int{1: 1, 3: 1}, effectsByN(t, db), "each effect once: the old owner's second rolled back")
	assert.Equal(t, uint64(1), ast.Handled, "A handled its first record only")
	assert.Zero(t, ast.DeadLettered)
	assert.Zero(t, ast.Retries)
	assert.Equal(t, map[int32]int64{0: 2}, offsetsRows(t, db, topic))
}

// A Source with OffsetsInDatabase is refused work unless a consumer bound
// it to its database.
func TestOffsetsInDatabaseNeedsConsumer(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	src := c.open(c.dbOffsetsConfig(uniq("g"), topic))
	_, err := src.Receive(context.Background())
	require.ErrorIs(t, err, errNotBound)

	cfg := c.dbOffsetsConfig(uniq("g"), topic)
	cfg.Sarama.Version = sarama.V2_4_0_0
	cfg.Sarama.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{sarama.NewBalanceStrategyCooperativeSticky()}
	_, err = Open(t.Context(), cfg)
	require.ErrorContains(t, err, "Config.OffsetsInDatabase")
}

// sarama runs the cooperative protocol when every balance strategy
// declares it (sarama.RebalanceProtocolBalanceStrategy), whatever their
// names; a partition a cooperative rebalance adds gets no Setup, so no
// take-over in the database. Open refused OffsetsInDatabase only with a
// strategy named cooperative-sticky: one of another name (a wrapper of
// sarama's, or a strategy of the service's own) was accepted, and every
// partition moved by a rebalance was claimed without a take-over,
// returned and the session ended, a rebalance more each time (two such
// claims when a second member joined a group of one, with a wrapper of
// cooperative-sticky on kfake). It is refused as well.
func TestOffsetsInDatabaseRefusesCooperativeStrategiesOfAnyName(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	for name, strategies := range map[string][]sarama.BalanceStrategy{
		"wrapper":         {renamedStrategy{sarama.NewBalanceStrategyCooperativeSticky(), nil}},
		"own cooperative": {renamedStrategy{sarama.NewBalanceStrategyRoundRobin(), []sarama.RebalanceProtocol{sarama.RebalanceProtocolCooperative, sarama.RebalanceProtocolEager}}},
	} {
		cfg := c.dbOffsetsConfig(uniq("g"), topic)
		cfg.Sarama.Consumer.Group.Rebalance.GroupStrategies = strategies
		s, err := Open(t.Context(), cfg)
		if s != nil {
			_ = s.Close()
		}
		require.Error(t, err, name)
		assert.Contains(t, err.Error(), "Config.OffsetsInDatabase needs the eager rebalance protocol", name)
		assert.Contains(t, err.Error(), "custom", name)
	}

	// A strategy of another name that declares only the eager protocol
	// is accepted.
	cfg := c.dbOffsetsConfig(uniq("g"), topic)
	cfg.Sarama.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{
		renamedStrategy{sarama.NewBalanceStrategyRange(), []sarama.RebalanceProtocol{sarama.RebalanceProtocolEager}}}
	s, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	require.NoError(t, s.Close())
}

// renamedStrategy is strategy under the name "custom", declaring the
// rebalance protocols protocols (nil: cooperative only).
type renamedStrategy struct {
	sarama.BalanceStrategy
	protocols []sarama.RebalanceProtocol
}

func (renamedStrategy) Name() string { return "custom" }

func (r renamedStrategy) SupportedProtocols() []sarama.RebalanceProtocol {
	if r.protocols == nil {
		return []sarama.RebalanceProtocol{sarama.RebalanceProtocolCooperative}
	}
	return r.protocols
}

// The offsets table tells a topic deleted and created again from the old
// one by the topic's id, which sarama asks for from Sarama.Version 2.8 on.
// With an older Version the new topic's partitions took the old rows over:
// their positions, beyond the new topic's end, were reset to the
// InitialOffset by sarama, the records handled were below the rows' and
// never recorded, and records without ids were handled again at every
// restart (measured: three records of the new topic, each effect twice
// after one restart). Open refuses OffsetsInDatabase with such a Version.
func TestOffsetsInDatabaseNeedsTopicIDs(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	cfg := c.dbOffsetsConfig(uniq("g"), topic)
	cfg.Sarama.Version = sarama.V2_7_0_0
	s, err := Open(t.Context(), cfg)
	if s != nil {
		_ = s.Close()
	}
	require.Error(t, err)
	assert.Contains(t, err.Error(), "Config.OffsetsInDatabase")
	assert.Contains(t, err.Error(), "Config.Sarama.Version")

	cfg.Sarama.Version = sarama.V2_8_0_0
	s, err = Open(t.Context(), cfg)
	require.NoError(t, err)
	require.NoError(t, s.Close())
}

// A dead-lettered record has no transaction of its own: its Ack records it
// done in the database. With the group's offsets lost, the restarted
// consumer neither dead-letters it again nor handles anything twice.
func TestOffsetsInDatabaseRecordsDeadLetters(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 1)
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	// n = 0 and 1, then a record that does not decode (last: nothing
	// after it moves the prefix over it).
	c.produce(append(mixedEvents(topic, 0, 2), msg(topic, 0, "not json"))...)

	src, err := Open(t.Context(), c.dbOffsetsConfig(group, topic))
	require.NoError(t, err)
	r := startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
	require.Eventually(t, func() bool { return r.c.Stats().DeadLettered == 1 && r.c.Stats().Handled == 2 },
		30*time.Second, 10*time.Millisecond)
	require.NoError(t, r.stop())
	assert.Equal(t, map[int32]int64{0: 3}, offsetsRows(t, db, topic), "the dead-lettered record is recorded done")

	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(t, err)
	require.NoError(t, admin.DeleteConsumerGroup(group))
	require.NoError(t, admin.Close())
	c.produce(mixedEvents(topic, 2, 1)...)
	st, _ := runToEnd(t, c, db, c.dbOffsetsConfig(group, topic), consumerConfig("svc"), 3)
	requireEachOnce(t, db, 3)
	assert.Equal(t, uint64(1), st.Handled)
	assert.Zero(t, st.DeadLettered)
	assert.Len(t, c.readAll(topic+".dlq"), 1, "one dead letter")
}

// wrapped is a delivery decorated by a wrapping Source.
type wrapped struct{ consumer.Delivery }

func (w wrapped) Unwrap() consumer.Delivery { return w.Delivery }

// RecordProgress finds its deliveries inside wrappers that unwrap, and
// refuses others.
func TestUnwrapDelivery(t *testing.T) {
	d := &delivery{}
	got, ok := unwrapDelivery(wrapped{wrapped{d}})
	require.True(t, ok)
	assert.Same(t, d, got)
	_, ok = unwrapDelivery(struct{ consumer.Delivery }{d})
	assert.False(t, ok, "a wrapper without Unwrap")
}

// A process with key lanes is killed while one slow record holds its lane
// and the other lanes committed records above it. The offsets row keeps
// those above the prefix; the restarted consumer handles the slow lane's
// records and skips the others: every effect once, though no record has an
// id and none has a processed-events row.
func TestOffsetsInDatabaseKeyLanesKilled(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		c := newClusterOf(t, kind)
		topic, group := uniq("orders"), uniq("g")
		c.createTopic(topic, 1)
		db, schema := pgtest.Schema(t)
		_, err := db.Exec(context.Background(), effectsTable)
		require.NoError(t, err)

		const lanes, n, slowFirst = 4, 41, 1
		keys := keysOffLane("slow", lanes, 5)
		var msgs []*sarama.ProducerMessage
		slow := 0
		for i := range n {
			key := keys[i%len(keys)]
			if i%10 == slowFirst {
				key = "slow"
				slow++
			}
			v, _ := json.Marshal(event{N: i})
			msgs = append(msgs, &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(key), Value: sarama.ByteEncoder(v)})
		}
		c.produceHashed(msgs)

		spec := crashChildSpec{
			brokers: strings.Join(c.addrs, ","), group: group, topic: topic, dbURL: pgtest.URL(), schema: schema, name: "svc",
			offsetsInDB: true, lanes: lanes, crashOnN: slowFirst, afterEffects: 20,
		}
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), spec.env()...)
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		require.ErrorAs(t, err, &exit, "child output:\n%s", out)
		require.Equal(t, crashExitCode, exit.ExitCode(), "child output:\n%s", out)

		before := effectsByN(t, db)
		require.GreaterOrEqual(t, len(before), 20, "the other lanes committed ahead of the slow record")
		for i := range n {
			if i%10 == slowFirst {
				require.Zero(t, before[i], "the slow lane's records are not done")
			}
		}
		assert.Equal(t, map[int32]int64{0: slowFirst}, offsetsRows(t, db, topic), "the prefix stops at the slow record")
		assert.Zero(t, processedRows(t, db))

		cfg := c.dbOffsetsConfig(group, topic)
		cfg.KeyLanes = lanes
		st, skipped := runToEnd(t, c, db, cfg, consumerConfig("svc"), n)
		requireEachOnce(t, db, n)
		assert.Equal(t, uint64(n-len(before)), st.Handled, "the records not done were handled")
		assert.Equal(t, int64(len(before)-slowFirst), skipped, "the records done above the slow one were skipped")
		assert.Zero(t, st.Duplicates)
		assert.Zero(t, processedRows(t, db))
	})
}

// The old owner's held transaction is also what the new owner waits for
// when both touch one row: here the crash guard's record of the held
// record (the first of A's assignment), which A's transaction deletes. B
// takes the partition over and waits; A, released, is fenced and rolls
// back, which lets B go on and handle the record: one effect.
func TestOffsetsInDatabaseFencedOwnerReleasesTheNewOne(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	db, schema := pgtest.Schema(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, effectsTable)
	require.NoError(t, err)
	c.produceHashed(mixedEvents(topic, 1, 1)) // n = 1: no id

	entered, release := make(chan struct{}), make(chan struct{})
	var abandoned atomic.Int32
	accfg := consumerConfig("svc")
	accfg.HandlerTimeout = time.Minute
	accfg.Hooks.OnOutcome = func(_ context.Context, o consumer.Outcome) {
		if o.Result == consumer.ResultAbandoned {
			abandoned.Add(1)
		}
	}
	srcA, err := Open(t.Context(), c.dbOffsetsConfig(uniq("g"), topic))
	require.NoError(t, err)
	a := startConsumer(t, db, srcA, accfg, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
		close(entered)
		<-release // ignores ctx: it outlives the take-over
		return recordEffect(ctx, tx, ev)
	})
	<-entered

	// B's connections carry a name of their own, so that the wait seen is
	// B's, whatever else runs on the server.
	app := uniq("member-b")
	pc, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	pc.ConnConfig.RuntimeParams["search_path"] = schema
	pc.ConnConfig.RuntimeParams["application_name"] = app
	poolB, err := pgxpool.NewWithConfig(ctx, pc)
	require.NoError(t, err)
	t.Cleanup(poolB.Close) // after B stops: cleanups run last in, first out
	srcB, err := Open(t.Context(), c.dbOffsetsConfig(uniq("g"), topic))
	require.NoError(t, err)
	b := startConsumer(t, poolB, srcB, consumerConfig("svc"), recordEffect)
	require.Eventually(t, func() bool {
		var waiting int
		require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name = $1`, app).Scan(&waiting))
		return waiting > 0
	}, 30*time.Second, 5*time.Millisecond, "B waits for A's transaction")
	assert.Empty(t, effectsByN(t, db))

	close(release)
	require.Eventually(t, func() bool { return abandoned.Load() == 1 }, 30*time.Second, 10*time.Millisecond,
		"A's transaction was fenced and its record abandoned")
	waitEffectsByN(t, db, 1)
	require.NoError(t, b.stop())
	require.NoError(t, a.stop())
	assert.Equal(t, map[int]int{1: 1}, effectsByN(t, db))
	assert.Equal(t, uint64(1), b.c.Stats().Handled)
	assert.Zero(t, a.c.Stats().Handled)
	assert.Equal(t, map[int32]int64{0: 1}, offsetsRows(t, db, topic))
}

// parseFallbackID reads back what claim.fallbackID writes, and refuses ids
// of any other shape.
func TestParseFallbackID(t *testing.T) {
	cl := &claim{stream: "orders.v2/3", topicID: "dPt4VFR3M6ZGOrsVzpV_iw"}
	key, offset, ok := parseFallbackID(cl.fallbackID(42))
	require.True(t, ok)
	assert.Equal(t, dedup.PartitionKey{Topic: "orders.v2", Partition: 3, TopicID: "dPt4VFR3M6ZGOrsVzpV_iw"}, key)
	assert.EqualValues(t, 42, offset)
	cl.topicID = ""
	key, offset, ok = parseFallbackID(cl.fallbackID(0))
	require.True(t, ok)
	assert.Equal(t, dedup.PartitionKey{Topic: "orders.v2", Partition: 3}, key)
	assert.EqualValues(t, 0, offset)
	for _, id := range []string{"", "order-7", "orders/3", "orders/3/4/5", "/3/4", "orders/x/4", "orders/3/-1", "orders/-3/4",
		"orders/99999999999/4", "amqp-sha256:ab"} {
		_, _, ok := parseFallbackID(id)
		assert.False(t, ok, id)
	}
}

// opaqueSource is a Source that decorates the deliveries of a kafka
// Source (it keeps the Source's methods, BindProgress and RecordProgress
// among them) but hides them: its deliveries have no Unwrap method.
type opaqueSource struct{ *Source }

func (o opaqueSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := o.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return struct{ consumer.Delivery }{d}, nil
}

// A Source wrapping this one whose deliveries do not unwrap made
// RecordProgress fail every transaction, which the consumer retried as an
// infrastructure failure for ever, handling nothing. RecordProgress
// cannot succeed on such a delivery: Receive now fails with the reason,
// and Run stops with it.
func TestOffsetsInDatabaseWrapperWithoutUnwrapStopsRun(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	c.produce(mixedEvents(topic, 0, 2)...)
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)

	src := c.open(c.dbOffsetsConfig(uniq("g"), topic))
	cn, err := consumer.New(db, opaqueSource{src}, recordEffect, consumerConfig("svc"))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err = cn.Run(ctx)
	require.Error(t, err)
	require.NoError(t, ctx.Err(), "Run stopped at once, not at its deadline: %v", err)
	t.Log(err)
	assert.Contains(t, err.Error(), "Unwrap() consumer.Delivery")
	assert.Empty(t, effectsByN(t, db), "nothing committed")
}

// hidingSource wraps a kafka Source behind the consumer.Source interface
// alone: the consumer does not see its BindProgress.
type hidingSource struct{ consumer.Source }

// A Source wrapping this one without forwarding BindProgress and
// RecordProgress leaves it unbound: Run stops at the first Receive, with an
// error that said to run the Source with consumer.New, which it was.
// The error now says what the wrapper lacks.
func TestOffsetsInDatabaseWrapperHidingBindProgress(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	db, _ := pgtest.Schema(t)
	src := c.open(c.dbOffsetsConfig(uniq("g"), topic))
	cn, err := consumer.New(db, hidingSource{src}, recordEffect, consumerConfig("svc"))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err = cn.Run(ctx)
	require.ErrorIs(t, err, errNotBound)
	t.Log(err)
	assert.Contains(t, err.Error(), "consumer.ProgressRecorder")
}
