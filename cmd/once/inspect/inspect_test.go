package inspect_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"strings"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/kversion"

	"github.com/onceco/once/cmd/once/inspect"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestConsumersAndRetention(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, pool))
	_, err = pool.Exec(ctx, `INSERT INTO processed_events (consumer, event_id, processed_at)
		SELECT 'billing', 'ev-' || i, now() - make_interval(hours => i) FROM generate_series(0, 2499) i`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO processed_events (consumer, event_id) VALUES ('shipping', 'a'), ('shipping', 'b')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO processed_events_attempts (consumer, event_id, attempts, crashes, last_seen) VALUES
		('billing', 'x', 1, 1, now()), ('billing', 'y', 3, 2, now()), ('billing', 'z', 1, 1, now() - interval '1 hour'),
		('billing', 'gone', 1, 1, now() - interval '2000 hours'), ('billing', 'retried', 2, 1, now()),
		('audit', 'q', 1, 1, now())`)
	require.NoError(t, err)

	cs, err := inspect.Consumers(ctx, pool, inspect.Tables{}, 10*time.Minute)
	require.NoError(t, err)
	require.Len(t, cs, 3)
	assert.Equal(t, "audit", cs[0].Name, "a consumer with attempt rows only is listed")
	assert.Zero(t, cs[0].Processed)
	b := cs[1]
	assert.Equal(t, "billing", b.Name)
	assert.EqualValues(t, 2500, b.Processed)
	assert.EqualValues(t, 5, b.InFlight)
	assert.EqualValues(t, 3, b.CrashSuspects, "crashed twice, or not seen for an hour or more; not run again after a failure")
	assert.Equal(t, 3, b.MaxAttempts)
	assert.WithinDuration(t, time.Now().Add(-2499*time.Hour), b.Oldest, time.Minute)
	assert.WithinDuration(t, time.Now(), b.Newest, time.Minute)
	assert.EqualValues(t, 2, cs[2].Processed)

	cutoff := time.Now().Add(-1000*time.Hour + 30*time.Minute) // rows 1000..2499 are older
	n, err := inspect.Retention(ctx, pool, inspect.Tables{}, "billing", cutoff, inspect.RetentionOptions{DryRun: true})
	require.NoError(t, err)
	assert.EqualValues(t, 1500, n)
	var progress []int64
	n, err = inspect.Retention(ctx, pool, inspect.Tables{}, "billing", cutoff, inspect.RetentionOptions{
		BatchSize: 400, Progress: func(d int64) { progress = append(progress, d) }})
	require.NoError(t, err)
	assert.EqualValues(t, 1500, n)
	assert.Equal(t, []int64{400, 800, 1200, 1500}, progress, "bounded batches")
	cs, err = inspect.Consumers(ctx, pool, inspect.Tables{}, 10*time.Minute)
	require.NoError(t, err)
	assert.EqualValues(t, 1000, cs[1].Processed)
	assert.EqualValues(t, 4, cs[1].InFlight, "the attempt row last seen before the cutoff went too")
	assert.EqualValues(t, 2, cs[2].Processed, "another consumer's rows stay")

	_, err = inspect.Retention(ctx, pool, inspect.Tables{}, "", cutoff, inspect.RetentionOptions{})
	require.Error(t, err)
	_, err = inspect.Consumers(ctx, pool, inspect.Tables{Table: "x; DROP TABLE y"}, time.Minute)
	require.ErrorIs(t, err, inspect.ErrInvalidName)
}

func TestKafkaLag(t *testing.T) {
	k := testenv.NewKafka(t)
	topic, group := testenv.Uniq("orders"), testenv.Uniq("g")
	k.CreateTopic(topic, 2)
	var msgs []*sarama.ProducerMessage
	for i := range 10 {
		msgs = append(msgs, &sarama.ProducerMessage{Topic: topic, Partition: int32(i % 2), Value: sarama.ByteEncoder(testenv.JSON(i, "ok")),
			Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(fmt.Sprint("ev-", i))}}})
	}
	k.Produce(msgs...)
	lag, err := inspect.KafkaLag(context.Background(), k.Addrs, testenv.Sarama(), group, []string{topic})
	require.NoError(t, err)
	require.Len(t, lag, 2)
	for _, l := range lag {
		assert.EqualValues(t, -1, l.Committed, "the group has committed nothing")
		assert.EqualValues(t, 5, l.Lag)
	}

	pool, _ := pgtest.Schema(t)
	svc := testenv.StartService(t, pool, k.Source(group, topic), "lagging")
	svc.Broken.Store(false)
	svc.WaitSettled(t, 10)
	svc.Stop()
	lag, err = inspect.KafkaLag(context.Background(), k.Addrs, testenv.Sarama(), group, []string{topic})
	require.NoError(t, err)
	assert.Equal(t, []inspect.PartitionLag{
		{Topic: topic, Partition: 0, Committed: 5, HighWater: 5, Lag: 0},
		{Topic: topic, Partition: 1, Committed: 5, HighWater: 5, Lag: 0},
	}, lag, "the stopped consumer committed everything")
	k.Produce(msgs[:3]...)
	lag, err = inspect.KafkaLag(context.Background(), k.Addrs, testenv.Sarama(), group, []string{topic})
	require.NoError(t, err)
	assert.EqualValues(t, []int64{2, 1}, []int64{lag[0].Lag, lag[1].Lag})
}

func TestAMQPDepth(t *testing.T) {
	url := testenv.AMQPURL(t)
	q := testenv.Uniq("depth")
	testenv.DeleteQueues(t, url, q)
	ch := testenv.AMQPChannel(t, url)
	_, err := ch.QueueDeclare(q, true, false, false, false, nil)
	require.NoError(t, err)
	for range 3 {
		testenv.PublishAMQP(t, ch, q, amqp091.Publishing{Body: []byte("x")})
	}
	d, err := inspect.AMQPDepth(context.Background(), url, []string{q})
	require.NoError(t, err)
	assert.Equal(t, []inspect.QueueDepth{{Queue: q, Ready: 3}}, d)
	_, err = inspect.AMQPDepth(context.Background(), url, []string{q + "-missing"})
	require.Error(t, err)
}

// Any suspect age counts: one below a millisecond too, whose Go spelling
// (1.5µs) PostgreSQL does not read as an interval. A negative one is
// refused rather than counting every attempt row as a crash suspect.
func TestConsumersTakesAnySuspectAge(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, pool))
	_, err = pool.Exec(ctx, `INSERT INTO processed_events_attempts (consumer, event_id, attempts, last_seen) VALUES
		('billing', 'old', 1, now() - interval '1 hour'), ('billing', 'new', 1, now() + interval '1 hour')`)
	require.NoError(t, err)
	for age, suspects := range map[time.Duration]int64{1500 * time.Nanosecond: 1, 90 * time.Minute: 0, 30 * time.Minute: 1, 0: 1} {
		cs, err := inspect.Consumers(ctx, pool, inspect.Tables{}, age)
		require.NoError(t, err, "suspect age %v", age)
		require.Len(t, cs, 1)
		assert.Equal(t, suspects, cs[0].CrashSuspects, "suspect age %v", age)
	}
	_, err = inspect.Consumers(ctx, pool, inspect.Tables{}, -time.Minute)
	require.Error(t, err, "a negative suspect age")
}

// A RabbitMQ URL that does not parse is refused without its password:
// the parser's error quotes the whole URL.
func TestAMQPDepthDoesNotPrintThePasswordOfAnUnparsableURL(t *testing.T) {
	for _, u := range []string{"amqp://guest:s3cr%zzet@127.0.0.1:1/", "amqp://guest:s3cret@127.0.0.1:1/%zz"} {
		_, err := inspect.AMQPDepth(context.Background(), u, []string{"orders"})
		require.Error(t, err, u)
		assert.NotContains(t, err.Error(), "s3cr", u)
		assert.Contains(t, err.Error(), "does not parse", u)
	}
}

// An offset the coordinator answers with an error for (here: the group's
// offsets of a topic the caller may not describe) is that error, not a
// group that committed nothing, whose lag would be every record retained.
func TestKafkaLagReportsAPartitionsOffsetError(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1))
	require.NoError(t, err)
	t.Cleanup(kf.Close)
	addrs := kf.ListenAddrs()
	topic, group := testenv.Uniq("orders"), testenv.Uniq("g")
	admin, err := sarama.NewClusterAdmin(addrs, testenv.Sarama())
	require.NoError(t, err)
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false))
	require.NoError(t, admin.Close())
	sc := testenv.Sarama()
	sc.Producer.Return.Successes = true
	prod, err := sarama.NewSyncProducer(addrs, sc)
	require.NoError(t, err)
	for range 3 {
		_, _, err = prod.SendMessage(&sarama.ProducerMessage{Topic: topic, Value: sarama.StringEncoder("x")})
		require.NoError(t, err)
	}
	require.NoError(t, prod.Close())

	kf.ControlKey(kmsg.OffsetFetch.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		kf.KeepControl()
		r := req.(*kmsg.OffsetFetchRequest)
		resp := r.ResponseKind().(*kmsg.OffsetFetchResponse)
		for _, rt := range r.Topics {
			t := kmsg.NewOffsetFetchResponseTopic()
			t.Topic = rt.Topic
			for _, p := range rt.Partitions {
				pr := kmsg.NewOffsetFetchResponseTopicPartition()
				pr.Partition, pr.Offset, pr.ErrorCode = p, -1, kerr.TopicAuthorizationFailed.Code
				t.Partitions = append(t.Partitions, pr)
			}
			resp.Topics = append(resp.Topics, t)
		}
		return resp, nil, true
	})
	lag, err := inspect.KafkaLag(context.Background(), addrs, testenv.Sarama(), group, []string{topic})
	require.Error(t, err, "lag reported as %+v", lag)
	assert.Contains(t, err.Error(), "authoriz")
}

// explaining is a Deleter that has PostgreSQL plan each statement, with
// its arguments, before running it.
type explaining struct {
	*pgxpool.Pool
	t     *testing.T
	plans []string
}

func (e *explaining) explain(ctx context.Context, sql string, args ...any) {
	rows, err := e.Pool.Query(ctx, "EXPLAIN "+sql, args...)
	require.NoError(e.t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(e.t, err)
	e.plans = append(e.plans, strings.Join(lines, "\n"))
}

func (e *explaining) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	e.explain(ctx, sql, args...)
	return e.Pool.Exec(ctx, sql, args...)
}

func (e *explaining) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	e.explain(ctx, sql, args...)
	return e.Pool.Query(ctx, sql, args...)
}

func (e *explaining) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	e.explain(ctx, sql, args...)
	return e.Pool.QueryRow(ctx, sql, args...)
}

// once retention walks the (consumer, processed_at) index, as the
// consumer's retention does, also when most of the consumer's rows are
// expired (a first sweep, or one after an outage): with a plain LIMIT the
// planner takes each batch from a sequential scan of the whole table,
// which starts again at its first page each time, so that a sweep costs
// the square of what it deletes.
func TestRetentionWalksTheIndexWhenMostRowsExpired(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, pool))
	for _, sql := range []string{
		`INSERT INTO processed_events (consumer, event_id, processed_at)
SELECT 'c1', 'e-' || i, now() - interval '30 days' + i * interval '1 second' FROM generate_series(1, 100000) i`,
		`ANALYZE processed_events`,
	} {
		_, err := pool.Exec(ctx, sql)
		require.NoError(t, err, sql)
	}
	db := &explaining{Pool: pool, t: t}
	n, err := inspect.Retention(ctx, db, inspect.Tables{}, "c1", time.Now().Add(-24*time.Hour), inspect.RetentionOptions{BatchSize: 5000})
	require.NoError(t, err)
	assert.EqualValues(t, 100000, n)
	require.NotEmpty(t, db.plans)
	for _, plan := range db.plans {
		require.NotRegexp(t, `Seq Scan on processed_events( |$)`, plan, "plan:\n%s", plan)
	}
}

// A broker that refuses the client's settings (here: a listener that asks
// for SASL, and a client without it) is said to refuse them, naming the
// broker, as the dead-letter reads do: not "run out of available
// brokers", which reads as a cluster that is down.
func TestKafkaLagSaysWhatTheBrokerRefused(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"),
		kfake.EnableSASL(), kfake.Superuser("PLAIN", "svc", "s3cret-pw"))
	require.NoError(t, err)
	t.Cleanup(kf.Close)
	sc := testenv.Sarama()
	sc.Metadata.Retry.Max = 0
	_, err = inspect.KafkaLag(context.Background(), kf.ListenAddrs(), sc, "g", []string{"orders"})
	require.Error(t, err)
	t.Log(err)
	assert.Contains(t, err.Error(), "refused the SASL settings")
	assert.Contains(t, err.Error(), kf.ListenAddrs()[0])
}

// HasRows knows a consumer by a processed row or an attempt row;
// ConsumerNames lists those with processed rows, sorted, up to its bound.
func TestHasRowsAndConsumerNames(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, pool))
	names, err := inspect.ConsumerNames(ctx, pool, inspect.Tables{}, 0)
	require.NoError(t, err)
	assert.Empty(t, names, "an empty table")
	_, err = pool.Exec(ctx, `INSERT INTO processed_events (consumer, event_id)
		SELECT c, 'ev-' || i FROM unnest(ARRAY['shipping', 'billing', 'audit']) c, generate_series(1, 50) i`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO processed_events_attempts (consumer, event_id, attempts, last_seen) VALUES ('inflight', 'q', 1, now())`)
	require.NoError(t, err)

	for name, want := range map[string]bool{"billing": true, "inflight": true, "biling": false, "": false} {
		got, err := inspect.HasRows(ctx, pool, inspect.Tables{}, name)
		require.NoError(t, err)
		assert.Equal(t, want, got, "%q", name)
	}
	names, err = inspect.ConsumerNames(ctx, pool, inspect.Tables{}, 0)
	require.NoError(t, err)
	assert.Equal(t, []string{"audit", "billing", "shipping"}, names)
	names, err = inspect.ConsumerNames(ctx, pool, inspect.Tables{}, 2)
	require.NoError(t, err)
	assert.Equal(t, []string{"audit", "billing"}, names)
	_, err = inspect.ConsumerNames(ctx, pool, inspect.Tables{Table: "no such"}, 0)
	assert.ErrorIs(t, err, inspect.ErrInvalidName)
}

func TestKafkaLagCountsNoOpenTransaction(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1))
	require.NoError(t, err)
	t.Cleanup(kf.Close)
	addrs := kf.ListenAddrs()
	topic, group := testenv.Uniq("orders"), testenv.Uniq("g")
	admin, err := sarama.NewClusterAdmin(addrs, testenv.Sarama())
	require.NoError(t, err)
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false))
	require.NoError(t, admin.Close())
	ctx := t.Context()
	transaction := func(commit bool, values ...string) *kgo.Client {
		tp, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.TransactionalID(testenv.Uniq("txn")),
			kgo.RecordPartitioner(kgo.ManualPartitioner()))
		require.NoError(t, err)
		t.Cleanup(tp.Close)
		require.NoError(t, tp.BeginTransaction())
		for _, v := range values {
			require.NoError(t, tp.ProduceSync(ctx, &kgo.Record{Topic: topic, Partition: 0, Value: []byte(v)}).FirstErr())
		}
		if commit {
			require.NoError(t, tp.EndTransaction(ctx, kgo.TryCommit))
		}
		return tp
	}
	transaction(true, "a") // a at 0, its commit marker at 1
	// The group read a: it commits the offset after it.
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.MaxVersions(kversion.V2_8_0()))
	require.NoError(t, err)
	defer cl.Close()
	commit := func(offset int64) {
		req := kmsg.NewPtrOffsetCommitRequest()
		req.Group, req.Generation = group, -1
		rt := kmsg.NewOffsetCommitRequestTopic()
		rt.Topic = topic
		rp := kmsg.NewOffsetCommitRequestTopicPartition()
		rp.Partition, rp.Offset = 0, offset
		rt.Partitions = append(rt.Partitions, rp)
		req.Topics = append(req.Topics, rt)
		resp, err := req.RequestWith(ctx, cl)
		require.NoError(t, err)
		require.NoError(t, kerr.ErrorForCode(resp.Topics[0].Partitions[0].ErrorCode))
	}
	commit(1)

	open := transaction(false, "open1", "open2") // at 2 and 3, not readable yet
	lag, err := inspect.KafkaLag(ctx, addrs, testenv.Sarama(), group, []string{topic})
	require.NoError(t, err)
	assert.Equal(t, []inspect.PartitionLag{{Topic: topic, Partition: 0, Committed: 1, HighWater: 2, Lag: 0}}, lag,
		"an open transaction's records are not lag yet, nor is the commit marker at 1, which no consumer is handed")

	require.NoError(t, open.EndTransaction(ctx, kgo.TryCommit)) // its marker at 4
	lag, err = inspect.KafkaLag(ctx, addrs, testenv.Sarama(), group, []string{topic})
	require.NoError(t, err)
	assert.Equal(t, []inspect.PartitionLag{{Topic: topic, Partition: 0, Committed: 1, HighWater: 5, Lag: 3}}, lag,
		"committed, its records are lag, counted from the first (2) to the end")

	// The group read them: it commits 4, the offset after open2.
	commit(4)
	require.NoError(t, transaction(false, "aborted").EndTransaction(ctx, kgo.TryAbort)) // at 5, its marker at 6
	lag, err = inspect.KafkaLag(ctx, addrs, testenv.Sarama(), group, []string{topic})
	require.NoError(t, err)
	assert.Equal(t, []inspect.PartitionLag{{Topic: topic, Partition: 0, Committed: 4, HighWater: 7, Lag: 0}}, lag,
		"caught up: the markers at 4 and 6 and the aborted record at 5 are handed to no one")
}

// Tables of a schema version before 3 have no crashes column: there an
// attempt row counted more than once is a crash suspect, as it was then,
// and Consumers does not fail on the column it does not find.
func TestConsumersOnAnAttemptsTableWithoutCrashes(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(ctx, `CREATE TABLE processed_events (consumer text, event_id text, processed_at timestamptz DEFAULT now());
		CREATE TABLE processed_events_attempts (consumer text, event_id text, attempts int, last_seen timestamptz DEFAULT now());
		INSERT INTO processed_events_attempts (consumer, event_id, attempts) VALUES ('billing', 'a', 1), ('billing', 'b', 2)`)
	require.NoError(t, err)
	cs, err := inspect.Consumers(ctx, pool, inspect.Tables{}, time.Hour)
	require.NoError(t, err)
	require.Len(t, cs, 1)
	assert.EqualValues(t, 2, cs[0].InFlight)
	assert.EqualValues(t, 1, cs[0].CrashSuspects)
}
