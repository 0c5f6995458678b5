package kafka

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/IBM/sarama"

	"github.com/onceco/once/internal/backoff"
)

// ensureDeadLetterTopics checks that the dead-letter topic of every topic
// in cfg.Topics exists, creating the missing ones when
// cfg.DeadLetter.Create is set. client is the dead-letter producer's
// client (auto-creation off) and pc its configuration.
func ensureDeadLetterTopics(ctx context.Context, cfg *Config, client sarama.Client, pc *sarama.Config) error {
	for _, topic := range cfg.Topics {
		dlq := cfg.DeadLetter.Topic(topic)
		exists, err := topicExists(client, dlq)
		if err != nil {
			return fmt.Errorf("kafka: looking up dead-letter topic %q of topic %q: %w", dlq, topic, err)
		}
		if exists {
			continue
		}
		if !cfg.DeadLetter.Create {
			return fmt.Errorf("%w: %q (the dead-letter topic of %q); create it, or set Config.DeadLetter.Create to let Open create it",
				ErrDeadLetterTopicMissing, dlq, topic)
		}
		if err := createDeadLetterTopic(ctx, client, pc, cfg.Brokers, topic, dlq); err != nil {
			return fmt.Errorf("kafka: creating dead-letter topic %q of topic %q: %w", dlq, topic, err)
		}
		cfg.Logger.Info("once/kafka: created dead-letter topic", "topic", dlq, "source_topic", topic)
	}
	return checkDeadLetterCleanup(cfg, client)
}

// checkDeadLetterCleanup refuses a compacted dead-letter topic
// (cleanup.policy holding "compact"): compaction keeps only the last copy
// of each key, and the broker refuses the copy of a record without a key,
// which would hold its partition at that record for ever. A cluster that
// does not answer (no DESCRIBE_CONFIGS ACL, a broker down) is not
// checked.
func checkDeadLetterCleanup(cfg *Config, client sarama.Client) error {
	source := make(map[string]string, len(cfg.Topics))
	req := &sarama.DescribeConfigsRequest{}
	for _, topic := range cfg.Topics {
		dlq := cfg.DeadLetter.Topic(topic)
		if _, seen := source[dlq]; !seen {
			source[dlq] = topic
			req.Resources = append(req.Resources, &sarama.ConfigResource{Type: sarama.TopicResource, Name: dlq, ConfigNames: []string{"cleanup.policy"}})
		}
	}
	version := client.Config().Version
	switch {
	case version.IsAtLeast(sarama.V2_0_0_0):
		req.Version = 2
	case version.IsAtLeast(sarama.V1_1_0_0):
		req.Version = 1
	}
	b := connectionOfItsOwn(client)
	if b == nil {
		return nil
	}
	defer b.Close()
	resp, err := b.DescribeConfigs(req)
	if err != nil {
		return nil
	}
	for _, r := range resp.Resources {
		if r.ErrorCode != 0 {
			continue
		}
		for _, e := range r.Configs {
			if e.Name == "cleanup.policy" && strings.Contains(e.Value, "compact") {
				return fmt.Errorf("kafka: dead-letter topic %q (of topic %q) is compacted (cleanup.policy=%s): compaction keeps only the last dead letter of each key, "+
					"and the copy of a record without a key is refused; give it cleanup.policy=delete and the retention you want for dead letters, or name another topic in Config.DeadLetter.Topic",
					r.Name, source[r.Name], e.Value)
			}
		}
	}
	return nil
}

// topicExists asks the cluster for topic's metadata.
func topicExists(client sarama.Client, topic string) (bool, error) {
	_, err := client.Partitions(topic)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, sarama.ErrUnknownTopicOrPartition):
		return false, nil
	default:
		return false, err
	}
}

// createDeadLetterTopic creates dlq with the partition count of topic (1
// when topic does not exist yet) and the broker's default replication
// factor, and waits until the client sees it (seeCreatedTopic). A topic
// created meanwhile by another instance is fine.
func createDeadLetterTopic(ctx context.Context, client sarama.Client, pc *sarama.Config, brokers []string, topic, dlq string) error {
	partitions := int32(1)
	if parts, err := client.Partitions(topic); err == nil && len(parts) > 0 {
		partitions = int32(len(parts))
	}
	// -1 asks for the broker's default.replication.factor (CreateTopics
	// v4+, Kafka 2.4); older protocol versions need an explicit factor.
	rf := int16(-1)
	if !pc.Version.IsAtLeast(sarama.V2_4_0_0) {
		rf = int16(min(3, len(client.Brokers())))
	}
	admin, err := sarama.NewClusterAdmin(brokers, pc)
	if err != nil {
		return err
	}
	defer admin.Close()
	err = admin.CreateTopic(dlq, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: rf}, false)
	if err != nil && !errors.Is(err, sarama.ErrTopicAlreadyExists) {
		return err
	}
	return seeCreatedTopic(ctx, client, dlq)
}

// seeCreatedTopic refreshes the client's metadata of topic, just created,
// until the cluster answers with it, or ctx ends. The controller answers
// CreateTopics before every broker has the topic in its metadata: a
// broker asked at once may answer UNKNOWN_TOPIC_OR_PARTITION (or
// LEADER_NOT_AVAILABLE) for a while on a loaded cluster, longer than the
// retries of one refresh (sarama's Metadata.Retry), and Open failed then.
func seeCreatedTopic(ctx context.Context, client sarama.Client, topic string) error {
	retry := backoff.Retrier{Policy: backoff.Policy{Initial: 100 * time.Millisecond, Max: 2 * time.Second}}
	for {
		err := client.RefreshMetadata(topic)
		if err == nil || !errors.Is(err, sarama.ErrUnknownTopicOrPartition) && !errors.Is(err, sarama.ErrLeaderNotAvailable) {
			return err
		}
		if !retry.Wait(ctx) {
			return fmt.Errorf("%s, created, not seen by the cluster until the context ended: %w", topic, err)
		}
	}
}

// topicIDs looks up topic ids (Kafka 2.8+, KIP-516): a topic deleted and
// created again under the same name gets a new id, while its offsets start
// at 0 again.
type topicIDs struct {
	client  sarama.Client
	version sarama.KafkaVersion
}

// lookup returns topic's id in Kafka's base64 form, or "" when the cluster
// or the configured protocol version has no topic ids. It retries
// transient failures with backoff until ctx is done.
func (t topicIDs) lookup(ctx context.Context, topic string) (string, error) {
	if !t.version.IsAtLeast(sarama.V2_8_0_0) {
		return "", nil
	}
	backoff := 50 * time.Millisecond
	for {
		id, err := t.lookupOnce(topic)
		if err == nil {
			return id, nil
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("kafka: looking up the id of topic %q: %w (last error: %w)", topic, ctx.Err(), err)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

// lookupOnce asks one broker for the topic's metadata on a connection of
// its own, opened and closed here: a connection shared with the client
// stays broken once it was cut (a sarama Broker does not reconnect by
// itself), and every later lookup on it would fail until the session
// ended, leaving the partition claimed but never fetched.
func (t topicIDs) lookupOnce(topic string) (string, error) {
	least := t.client.LeastLoadedBroker()
	if least == nil {
		return "", errors.New("no broker available")
	}
	b := sarama.NewBroker(least.Addr())
	if err := b.Open(t.client.Config()); err != nil {
		return "", err
	}
	defer b.Close()
	resp, err := b.GetMetadata(sarama.NewMetadataRequest(t.version, []string{topic}))
	if err != nil {
		return "", err
	}
	for _, tm := range resp.Topics {
		if tm.Name != topic {
			continue
		}
		if !errors.Is(tm.Err, sarama.ErrNoError) {
			return "", tm.Err
		}
		if tm.Uuid == (sarama.Uuid{}) {
			return "", nil // a broker that predates topic ids
		}
		return base64.RawURLEncoding.EncodeToString(tm.Uuid[:]), nil
	}
	return "", fmt.Errorf("topic %q missing from the metadata response", topic)
}

// connectionOfItsOwn opens a connection to the client's least loaded
// broker that is not the client's own (whose connection stays broken once
// cut, as topicIDs.lookupOnce explains), or returns nil when there is no
// broker to ask or the connection fails: the checks that use it leave what
// they cannot ask to the consume and the copies. The caller closes it.
func connectionOfItsOwn(client sarama.Client) *sarama.Broker {
	least := client.LeastLoadedBroker()
	if least == nil {
		return nil
	}
	b := sarama.NewBroker(least.Addr())
	if err := b.Open(client.Config()); err != nil {
		return nil
	}
	return b
}
