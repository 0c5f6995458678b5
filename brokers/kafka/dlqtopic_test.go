package kafka

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/kafkatemp"
	"github.com/onceco/once/internal/pgtest"
)

// A dead-letter topic that does not exist is found by Open, with an
// error naming it, instead of wedging a partition at the first poison
// record. Apache Kafka runs with topic auto-creation off, as production
// clusters do.
func TestMissingDeadLetterTopicFailsAtStart(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		c := newClusterOf(t, kind)
		topic, other := uniq("orders"), uniq("payments")
		c.createTopic(topic, 1)
		c.createTopic(other, 1)
		c.createTopic(other+".dlq", 1)

		cfg := c.config(uniq("g"), other, topic)
		cfg.DeadLetter.Create = false
		s, err := Open(t.Context(), cfg)
		require.Error(t, err)
		assert.Nil(t, s)
		assert.ErrorIs(t, err, ErrDeadLetterTopicMissing)
		assert.Contains(t, err.Error(), `"`+topic+`.dlq"`, "the error names the missing topic")
		assert.Contains(t, err.Error(), "DeadLetter.Create", "the error says how to have it created")
		assert.NotContains(t, err.Error(), other+".dlq", "only the missing topic is named")
		assert.NotContains(t, listTopics(t, c), topic+".dlq", "nothing was created")
	})
}

// With DeadLetter.Create, Open creates a missing dead-letter
// topic with its source topic's partition count, and a poison record ends
// in it.
func TestMissingDeadLetterTopicCreatedWhenAllowed(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		c := newClusterOf(t, kind)
		topic, group := uniq("orders"), uniq("g")
		c.createTopic(topic, 3)
		c.produceHashed(append(events(topic, "ev", 0, 3), &sarama.ProducerMessage{Topic: topic,
			Value: sarama.StringEncoder("not json"), Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte("poison-1")}}}))

		cfg := c.config(group, topic)
		cfg.DeadLetter.Create = true
		src, err := Open(t.Context(), cfg)
		require.NoError(t, err)
		assert.Equal(t, int32(3), partitionCount(t, c, topic+".dlq"))

		// A second source finds the topic and creates nothing.
		again, err := Open(t.Context(), cfg)
		require.NoError(t, err)
		require.NoError(t, again.Close())

		db, _ := pgtest.Schema(t)
		_, err = db.Exec(context.Background(), effectsTable)
		require.NoError(t, err)
		r := startConsumer(t, db, src, consumerConfig("orders-svc"), recordEffect)
		waitEffects(t, db, 3, 30*time.Second)
		require.Eventually(t, func() bool { return r.c.Stats().DeadLettered == 1 }, 30*time.Second, 10*time.Millisecond)
		require.NoError(t, r.stop())
		requireExactlyOnce(t, db, "ev", 3)
		dl := c.readAll(topic + ".dlq")
		require.Len(t, dl, 1)
		assert.Equal(t, []byte("not json"), dl[0].Value)
	})
}

// When the dead-letter destination hangs (kfake: produce requests never
// answered; Apache Kafka: the broker frozen with SIGSTOP), stopping the
// consumer still ends within ShutdownTimeout plus Config.CloseTimeout: the
// hanging copy is abandoned, its record not acked (delivered again later).
func TestShutdownBoundedWhenDeadLetterHangs(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		var c *cluster
		if kind == kfakeBroker {
			c = newCluster(t)
		} else {
			c = newApacheKafka(t, kafkatemp.Options{})
		}
		topic, group := uniq("orders"), uniq("g")
		c.createTopic(topic, 1)
		c.createTopic(topic+".dlq", 1)
		c.produceHashed(events(topic, "ev", 0, 1))

		release := make(chan struct{})
		t.Cleanup(func() { close(release) })
		hang := func() {
			if kind == kfakeBroker {
				c.kf.ControlKey(kmsg.Produce.Int16(), func(kmsg.Request) (kmsg.Response, error, bool) {
					c.kf.KeepControl()
					c.kf.SleepControl(func() { <-release })
					return nil, nil, false
				})
				return
			}
			require.NoError(t, c.real.Freeze(0))
			t.Cleanup(func() { _ = c.real.Thaw(0) })
		}

		db, _ := pgtest.Schema(t)
		cfg := c.config(group, topic)
		cfg.CloseTimeout = 2 * time.Second
		src, err := Open(t.Context(), cfg)
		require.NoError(t, err)
		ccfg := consumerConfig("orders-svc")
		ccfg.ShutdownTimeout = time.Second
		handled := make(chan struct{})
		r := startConsumer(t, db, src, ccfg, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
			select {
			case <-handled:
			default:
				hang() // the dead-letter copy of this record will hang
				close(handled)
			}
			return consumer.Permanent(errors.New("rejected"))
		})
		select {
		case <-handled:
		case <-time.After(30 * time.Second):
			t.Fatal("the record was not handled")
		}
		// Let the dead-letter send start and hang.
		require.Eventually(t, func() bool { return src.sendsRunning() > 0 }, 10*time.Second, 5*time.Millisecond)

		start := time.Now()
		stopped := make(chan error, 1)
		go func() { stopped <- r.stop() }()
		bound := ccfg.ShutdownTimeout + cfg.CloseTimeout + 5*time.Second
		select {
		case err := <-stopped:
			t.Logf("stopped in %v (%v)", time.Since(start), err)
			assert.ErrorIs(t, err, ErrCloseTimeout, "the Close that did not finish says so, for the caller to tell it apart")
		case <-time.After(bound):
			t.Fatalf("shutdown took more than %v with the dead-letter destination hanging", bound)
		}
		assert.Zero(t, r.c.Stats().DeadLettered, "the hanging copy was not counted as written")
	})
}

// listTopics returns the cluster's topics.
func listTopics(t testing.TB, c *cluster) map[string]sarama.TopicDetail {
	t.Helper()
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(t, err)
	defer admin.Close()
	topics, err := admin.ListTopics()
	require.NoError(t, err)
	return topics
}

// partitionCount returns the number of partitions of topic.
func partitionCount(t testing.TB, c *cluster, topic string) int32 {
	t.Helper()
	d, ok := listTopics(t, c)[topic]
	require.True(t, ok, "topic %s exists", topic)
	return d.NumPartitions
}

// A compacted dead-letter topic (cleanup.policy compact) keeps only the
// last copy of each key, and Kafka refuses the copy of a record without a
// key ("failed the validation on broker"): the core retried it without
// end, its partition held at the record. Open refuses such a topic,
// naming it and its policy.
func TestCompactedDeadLetterTopicRefusedAtOpen(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		c := newClusterOf(t, kind)
		topic, other := uniq("orders"), uniq("payments")
		c.createTopic(topic, 1)
		c.createTopic(other, 1)
		c.createTopic(other+".dlq", 1)
		admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
		require.NoError(t, err)
		defer admin.Close()
		policy := "compact,delete"
		require.NoError(t, admin.CreateTopic(topic+".dlq", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
			ConfigEntries: map[string]*string{"cleanup.policy": &policy}}, false))
		c.awaitLeaders(topic+".dlq", 1)

		cfg := c.config(uniq("g"), other, topic)
		cfg.DeadLetter.Create = false
		s, err := Open(t.Context(), cfg)
		if s != nil {
			_ = s.Close()
		}
		require.Error(t, err)
		t.Log(err)
		assert.Contains(t, err.Error(), `"`+topic+`.dlq"`, "the error names the topic")
		assert.Contains(t, err.Error(), "cleanup.policy")
		assert.NotContains(t, err.Error(), other+".dlq")

		require.NoError(t, admin.AlterConfig(sarama.TopicResource, topic+".dlq", map[string]*string{"cleanup.policy": ptr("delete")}, false))
		s, err = Open(t.Context(), cfg)
		require.NoError(t, err, "a dead-letter topic that deletes by retention is fine")
		require.NoError(t, s.Close())
	})
}

func ptr[T any](v T) *T { return &v }
