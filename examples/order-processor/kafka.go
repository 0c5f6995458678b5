package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceco/once/brokers/kafka"
)

// embeddedKafka is an in-process Kafka-protocol broker (kfake) on a loopback
// port. Its data lives in memory and is gone when it closes.
type embeddedKafka struct {
	cluster *kfake.Cluster
	addrs   []string
}

// startEmbeddedKafka starts a one-broker kfake cluster on port (0: a free
// one) with topic and its dead-letter topic created with the given
// partitions. It accepts session timeouts down to 500 ms, so that a member
// that died is noticed quickly.
func startEmbeddedKafka(port int, topic string, partitions int32) (*embeddedKafka, error) {
	opts := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.GroupMinSessionTimeout(500 * time.Millisecond),
		kfake.SeedTopics(partitions, topicsOf(topic)...),
	}
	if port > 0 {
		opts = append(opts, kfake.Ports(port))
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		return nil, fmt.Errorf("start the embedded Kafka broker: %w", err)
	}
	return &embeddedKafka{cluster: c, addrs: c.ListenAddrs()}, nil
}

// Close stops the broker.
func (k *embeddedKafka) Close() { k.cluster.Close() }

// saramaConfig is the client configuration of every Kafka client here.
func saramaConfig() *sarama.Config {
	sc := sarama.NewConfig()
	sc.ClientID = "order-processor"
	if id := os.Getenv("KAFKA_CLIENT_ID"); id != "" {
		sc.ClientID = id // a chaos member's: which process a group member is
	}
	sc.Version = sarama.V2_8_0_0
	sc.Metadata.Retry.Backoff = 100 * time.Millisecond
	sc.Consumer.Retry.Backoff = 100 * time.Millisecond
	sc.Producer.Retry.Backoff = 100 * time.Millisecond
	return sc
}

// kafkaSource opens the consumer-group source. fastFailover shortens the
// group timeouts so that a killed member's partitions move within about
// three seconds (the embedded broker allows it; a real broker's minimum
// session timeout is usually 6 s).
func kafkaSource(ctx context.Context, o *options, mp metric.MeterProvider, log *slog.Logger) (*kafka.Source, error) {
	cfg := kafka.Config{
		Brokers:        o.kafkaBrokers,
		Group:          o.name,
		Topics:         []string{o.topic},
		CommitInterval: 250 * time.Millisecond,
		Sarama:         saramaConfig(),
		MeterProvider:  mp,
		Logger:         log,
		// The database's positions over the group's (chaos -offsets-in-database).
		OffsetsInDatabase: o.offsetsInDB,
	}
	if o.fastFailover {
		ff := fastFailover
		cfg.SessionTimeout, cfg.HeartbeatInterval, cfg.RebalanceTimeout, cfg.RevokeTimeout = ff.session, ff.heartbeat, ff.rebalance, ff.revoke
	}
	return kafka.Open(ctx, cfg)
}

// fastFailover is the group timing of -fast-failover (the chaos members).
// The session outlasts a whole rebalance (RebalanceTimeout after the last
// heartbeat, plus a heartbeat and a fetch's wait for the connection): the
// embedded broker, unlike Apache Kafka, lets the session of a member that
// waits in JoinGroup expire, and drops it unanswered, so a session shorter
// than a slow rebalance stalled its member for sarama's 30 s read timeout
// (TestFastFailoverOutlastsARebalanceOnTheEmbeddedBroker).
var fastFailover = struct{ session, heartbeat, rebalance, revoke time.Duration }{
	session: 3 * time.Second, heartbeat: 200 * time.Millisecond, rebalance: 1500 * time.Millisecond, revoke: time.Second,
}

// topicsOf returns the topics of a run on topic: the orders, order.confirmed
// (the second hop, shipping.go), and the dead-letter topic of each.
func topicsOf(topic string) []string {
	confirmed := topic + ".confirmed"
	return []string{topic, topic + kafka.DefaultDeadLetterSuffix, confirmed, confirmed + kafka.DefaultDeadLetterSuffix}
}

// createKafkaTopics creates the topics of topicsOf(topic) on a real
// cluster; topics that exist already are fine.
func createKafkaTopics(addrs []string, topic string, partitions int32) error {
	admin, err := sarama.NewClusterAdmin(addrs, saramaConfig())
	if err != nil {
		return err
	}
	defer admin.Close()
	for _, t := range topicsOf(topic) {
		err := admin.CreateTopic(t, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false)
		if err != nil && !errors.Is(err, sarama.ErrTopicAlreadyExists) {
			return fmt.Errorf("create topic %s: %w", t, err)
		}
	}
	return nil
}

// kafkaPublisher publishes generated traffic with a synchronous, idempotent
// producer, keyed by order id so that the events of one order share a
// partition.
type kafkaPublisher struct {
	p     sarama.SyncProducer
	topic string
}

func newKafkaPublisher(addrs []string, topic string) (*kafkaPublisher, error) {
	sc := saramaConfig()
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Idempotent = true
	sc.Net.MaxOpenRequests = 1
	p, err := sarama.NewSyncProducer(addrs, sc)
	if err != nil {
		return nil, err
	}
	return &kafkaPublisher{p: p, topic: topic}, nil
}

// Publish sends msgs in batches and returns once the broker acknowledged
// them all.
func (k *kafkaPublisher) Publish(_ context.Context, msgs []outMsg) error {
	const batch = 500
	for len(msgs) > 0 {
		n := min(batch, len(msgs))
		out := make([]*sarama.ProducerMessage, n)
		for i, m := range msgs[:n] {
			pm := &sarama.ProducerMessage{Topic: k.topic, Key: sarama.StringEncoder(m.Key), Value: sarama.ByteEncoder(m.Value)}
			if m.ID != "" {
				pm.Headers = append(pm.Headers, sarama.RecordHeader{Key: []byte("id"), Value: []byte(m.ID)})
			}
			pm.Headers = append(pm.Headers, sarama.RecordHeader{Key: []byte("type"), Value: []byte(m.Type)})
			out[i] = pm
		}
		if err := k.p.SendMessages(out); err != nil {
			return err
		}
		msgs = msgs[n:]
	}
	return nil
}

// Close closes the producer.
func (k *kafkaPublisher) Close() error { return k.p.Close() }

// readKafkaTopic reads every record of topic up to the partitions' current
// ends.
func readKafkaTopic(addrs []string, topic string) ([]deadLetter, error) {
	client, err := sarama.NewClient(addrs, saramaConfig())
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
	var out []deadLetter
	for _, p := range parts {
		end, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return nil, err
		}
		if end == 0 {
			continue
		}
		pc, err := cons.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			return nil, err
		}
		for done := false; !done; {
			select {
			case m := <-pc.Messages():
				h := map[string]string{}
				for _, rh := range m.Headers {
					h[string(rh.Key)] = string(rh.Value)
				}
				out = append(out, deadLetter{Key: m.Key, Value: m.Value, Headers: h})
				done = m.Offset+1 >= end
			case err := <-pc.Errors():
				pc.Close()
				return nil, err
			case <-time.After(10 * time.Second):
				pc.Close()
				return nil, fmt.Errorf("read %s/%d: timed out", topic, p)
			}
		}
		if err := pc.Close(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// kafkaDrained reports whether group has committed offsets up to the end
// of every partition of topic: every record is settled (handled, skipped as
// a duplicate, or dead-lettered) and its ack reached the broker.
type kafkaDrained struct {
	addrs  []string
	client sarama.Client
	admin  sarama.ClusterAdmin
	group  string
	topic  string
}

func newKafkaDrained(addrs []string, group, topic string) (*kafkaDrained, error) {
	k := &kafkaDrained{addrs: addrs, group: group, topic: topic}
	if err := k.connect(); err != nil {
		return nil, err
	}
	return k, nil
}

// connect opens the client and the admin the lag is read through.
func (k *kafkaDrained) connect() error {
	client, err := sarama.NewClient(k.addrs, saramaConfig())
	if err != nil {
		return err
	}
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		client.Close()
		return err
	}
	k.client, k.admin = client, admin
	return nil
}

// Lag returns the records of topic not yet committed by the group. After
// a failure it opens new connections for the next call: the chaos run cuts
// every connection to the broker, this one's too, and a cut connection of
// sarama's admin can keep failing until it is replaced.
func (k *kafkaDrained) Lag(ctx context.Context) (int64, error) {
	lag, err := k.lag()
	if err != nil {
		_ = k.admin.Close()
		if cerr := k.connect(); cerr != nil {
			return 0, errors.Join(err, cerr)
		}
	}
	return lag, err
}

func (k *kafkaDrained) lag() (int64, error) {
	parts, err := k.client.Partitions(k.topic)
	if err != nil {
		return 0, err
	}
	resp, err := k.admin.ListConsumerGroupOffsets(k.group, map[string][]int32{k.topic: parts})
	if errors.Is(err, sarama.ErrGroupIDNotFound) {
		resp, err = &sarama.OffsetFetchResponse{}, nil // no member has joined yet: nothing committed
	}
	if err != nil {
		return 0, err
	}
	var lag int64
	for _, p := range parts {
		end, err := k.client.GetOffset(k.topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, err
		}
		committed := int64(0)
		if b := resp.GetBlock(k.topic, p); b != nil && b.Offset > 0 {
			committed = b.Offset
		}
		lag += end - committed
	}
	return lag, nil
}

func (k *kafkaDrained) Close() error { return k.admin.Close() }
