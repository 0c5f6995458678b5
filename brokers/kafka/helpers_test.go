package kafka

import (
	"context"
	"io"
	"log"
	"log/slog"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/internal/kafkatemp"
	"github.com/onceco/once/internal/kafkatest"
	"github.com/onceco/once/internal/pgtest"
)

func TestMain(m *testing.M) {
	if os.Getenv("ONCE_TEST_LOG") != "" {
		sarama.Logger = log.New(os.Stderr, "[sarama] ", log.Lmicroseconds)
	}
	if os.Getenv(crashChildEnv) != "" {
		os.Exit(runCrashChild())
	}
	pgtest.Main(m)
}

// testLogger discards logs unless ONCE_TEST_LOG is set.
func testLogger() *slog.Logger {
	if os.Getenv("ONCE_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// brokerKind is the Kafka implementation a test runs against.
type brokerKind string

const (
	// kfake is the in-process implementation of the protocol
	// (github.com/twmb/franz-go/pkg/kfake): fast, and scriptable.
	kfakeBroker brokerKind = "kfake"
	// apacheKafka is Apache Kafka itself (internal/kafkatemp): a KRaft
	// node in its own JVM, with topic auto-creation off.
	apacheKafka brokerKind = "apache-kafka"
)

// brokerKinds are the implementations the shared adapter tests run on.
var brokerKinds = []brokerKind{kfakeBroker, apacheKafka}

// eachBroker runs fn as a subtest per broker kind. On Apache Kafka the
// subtest is skipped when no broker can be started, or fails under
// ONCE_REQUIRE_SERVERS=1.
func eachBroker(t *testing.T, fn func(t *testing.T, kind brokerKind)) {
	for _, kind := range brokerKinds {
		t.Run(string(kind), func(t *testing.T) { fn(t, kind) })
	}
}

// cluster is a Kafka cluster spoken to over TCP: an in-process kfake
// cluster, or a throwaway Apache Kafka cluster.
type cluster struct {
	t     testing.TB
	kind  brokerKind
	kf    *kfake.Cluster     // kfake only
	real  *kafkatemp.Cluster // Apache Kafka only
	addrs []string
}

// newCluster starts a one-broker kfake cluster that accepts short session
// timeouts, closed when the test ends.
func newCluster(t testing.TB, opts ...kfake.Opt) *cluster {
	t.Helper()
	opts = append([]kfake.Opt{kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(200 * time.Millisecond)}, opts...)
	kf, err := kfake.NewCluster(opts...)
	require.NoError(t, err)
	c := &cluster{t: t, kind: kfakeBroker, kf: kf, addrs: kf.ListenAddrs()}
	t.Cleanup(func() { c.kf.Close() })
	return c
}

// newClusterOf returns a cluster of kind: a fresh kfake cluster, or the
// test binary's shared Apache Kafka node (tests use topic and group names
// of their own: uniq).
func newClusterOf(t testing.TB, kind brokerKind) *cluster {
	t.Helper()
	if kind == kfakeBroker {
		return newCluster(t)
	}
	real := kafkatest.Shared(t)
	return &cluster{t: t, kind: apacheKafka, real: real, addrs: real.Brokers()}
}

// newApacheKafka starts an Apache Kafka cluster of the test's own, for
// tests that stop, kill or reconfigure brokers.
func newApacheKafka(t testing.TB, opts kafkatemp.Options) *cluster {
	t.Helper()
	real := kafkatest.Start(t, opts)
	return &cluster{t: t, kind: apacheKafka, real: real, addrs: real.Brokers()}
}

var seq atomic.Int64

// uniq returns a name unique in this test binary.
func uniq(prefix string) string { return prefix + "-" + strconv.FormatInt(seq.Add(1), 10) }

func saramaConfig() *sarama.Config {
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	sc.Metadata.Retry.Backoff = 50 * time.Millisecond
	sc.Consumer.Retry.Backoff = 50 * time.Millisecond
	sc.Producer.Retry.Backoff = 50 * time.Millisecond
	return sc
}

// createTopic creates topic with the given partitions (replication factor
// 1, or the cluster's node count up to 3 on Apache Kafka) and waits until
// every partition has a leader.
func (c *cluster) createTopic(topic string, partitions int32) {
	c.t.Helper()
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(c.t, err)
	defer admin.Close()
	rf := int16(1)
	if c.real != nil {
		rf = int16(min(3, c.real.Nodes()))
	}
	require.NoError(c.t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: rf}, false))
	c.awaitLeaders(topic, partitions)
}

// awaitLeaders waits until metadata shows a leader for each of the
// topic's partitions: Apache Kafka creates topics asynchronously.
func (c *cluster) awaitLeaders(topic string, partitions int32) {
	c.t.Helper()
	client, err := sarama.NewClient(c.addrs, saramaConfig())
	require.NoError(c.t, err)
	defer client.Close()
	require.Eventually(c.t, func() bool {
		if client.RefreshMetadata(topic) != nil {
			return false
		}
		parts, err := client.Partitions(topic)
		if err != nil || int32(len(parts)) != partitions {
			return false
		}
		for _, p := range parts {
			if _, err := client.Leader(topic, p); err != nil {
				return false
			}
		}
		return true
	}, 30*time.Second, 20*time.Millisecond, "topic %s has no leaders", topic)
}

// topicID returns topic's id as the adapter writes it in fallback ids.
func (c *cluster) topicID(topic string) string {
	c.t.Helper()
	client, err := sarama.NewClient(c.addrs, saramaConfig())
	require.NoError(c.t, err)
	defer client.Close()
	id, err := topicIDs{client: client, version: saramaConfig().Version}.lookupOnce(topic)
	require.NoError(c.t, err)
	return id
}

// deleteTopic deletes topic and waits until the cluster no longer lists it.
func (c *cluster) deleteTopic(topic string) {
	c.t.Helper()
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(c.t, err)
	defer admin.Close()
	require.NoError(c.t, admin.DeleteTopic(topic))
	require.Eventually(c.t, func() bool {
		topics, err := admin.ListTopics()
		_, listed := topics[topic]
		return err == nil && !listed
	}, 30*time.Second, 20*time.Millisecond, "topic %s still listed", topic)
}

// config is a Source configuration with timeouts short enough for tests.
// It lets Open create missing dead-letter topics, so tests that are not
// about dead letters need not create them.
func (c *cluster) config(group string, topics ...string) Config {
	return Config{
		Brokers:           c.addrs,
		Group:             group,
		Topics:            topics,
		DeadLetter:        DeadLetterConfig{Create: true},
		SessionTimeout:    2 * time.Second,
		HeartbeatInterval: 100 * time.Millisecond,
		RebalanceTimeout:  8 * time.Second,
		RevokeTimeout:     4 * time.Second,
		CommitInterval:    100 * time.Millisecond,
		FetchMaxWait:      50 * time.Millisecond,
		Sarama:            saramaConfig(),
		Logger:            testLogger(),
	}
}

// open starts a Source that is closed when the test ends.
func (c *cluster) open(cfg Config) *Source {
	c.t.Helper()
	s, err := Open(c.t.Context(), cfg)
	require.NoError(c.t, err)
	c.t.Cleanup(func() { _ = s.Close() })
	return s
}

// producer returns a synchronous producer, closed when the test ends.
func (c *cluster) producer() sarama.SyncProducer {
	c.t.Helper()
	sc := saramaConfig()
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	// Idempotent: a produce retried under load must not write a record
	// twice, since records without ids are events by their offsets.
	sc.Producer.Idempotent = true
	sc.Net.MaxOpenRequests = 1
	p, err := sarama.NewSyncProducer(c.addrs, sc)
	require.NoError(c.t, err)
	c.t.Cleanup(func() { _ = p.Close() })
	return p
}

// produce writes msgs (partition chosen by ProducerMessage.Partition) and
// waits for the broker's acks.
func (c *cluster) produce(msgs ...*sarama.ProducerMessage) {
	c.t.Helper()
	require.NoError(c.t, c.producer().SendMessages(msgs))
}

// deleteRecordsBefore deletes the records of topic's partition below
// offset, as retention does.
func (c *cluster) deleteRecordsBefore(topic string, partition int32, offset int64) {
	c.t.Helper()
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(c.t, err)
	defer admin.Close()
	require.NoError(c.t, admin.DeleteRecords(topic, map[int32]int64{partition: offset}))
}

// readAll returns every record of topic, partition by partition, in offset
// order.
func (c *cluster) readAll(topic string) []*sarama.ConsumerMessage {
	c.t.Helper()
	out, err := readTopic(c.addrs, topic)
	require.NoError(c.t, err)
	return out
}

// readTopic reads every record of topic up to its high-water marks with a
// plain sarama consumer.
func readTopic(addrs []string, topic string) ([]*sarama.ConsumerMessage, error) {
	return readTopicAs(addrs, saramaConfig(), topic)
}

// readTopicAs is readTopic with the client configuration sc.
func readTopicAs(addrs []string, sc *sarama.Config, topic string) ([]*sarama.ConsumerMessage, error) {
	client, err := sarama.NewClient(addrs, sc)
	if err != nil {
		return nil, err
	}
	defer client.Close()
	parts, err := client.Partitions(topic)
	if err != nil {
		return nil, err
	}
	cons, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return nil, err
	}
	defer cons.Close()
	var out []*sarama.ConsumerMessage
	for _, p := range parts {
		hwm, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return nil, err
		}
		if hwm == 0 {
			continue
		}
		pc, err := cons.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			return nil, err
		}
		timeout := time.NewTimer(10 * time.Second)
		for done := false; !done; {
			select {
			case m := <-pc.Messages():
				out = append(out, m)
				done = m.Offset >= hwm-1
			case <-timeout.C:
				_ = pc.Close()
				return nil, context.DeadlineExceeded
			}
		}
		timeout.Stop()
		if err := pc.Close(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// committed returns the group's committed offset of each partition of
// topic (-1 where none).
func (c *cluster) committed(group, topic string, partitions int32) map[int32]int64 {
	c.t.Helper()
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(c.t, err)
	defer admin.Close()
	parts := make([]int32, partitions)
	for i := range parts {
		parts[i] = int32(i)
	}
	resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: parts})
	require.NoError(c.t, err)
	out := make(map[int32]int64, partitions)
	for p, b := range resp.Blocks[topic] {
		require.Equal(c.t, sarama.ErrNoError, b.Err)
		out[p] = b.Offset
	}
	return out
}

// receive calls Receive with a deadline.
func receive(t testing.TB, s *Source) *delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	d, err := s.Receive(ctx)
	require.NoError(t, err)
	return d.(*delivery)
}

// receiveN receives n deliveries.
func receiveN(t testing.TB, s *Source, n int) []*delivery {
	t.Helper()
	out := make([]*delivery, 0, n)
	for range n {
		out = append(out, receive(t, s))
	}
	return out
}

// msg is a record for partition p of topic with value v.
func msg(topic string, p int32, v string, headers ...string) *sarama.ProducerMessage {
	m := &sarama.ProducerMessage{Topic: topic, Partition: p, Value: sarama.StringEncoder(v)}
	for i := 0; i+1 < len(headers); i += 2 {
		m.Headers = append(m.Headers, sarama.RecordHeader{Key: []byte(headers[i]), Value: []byte(headers[i+1])})
	}
	return m
}
