package inspect

import (
	"errors"
	"fmt"
	"net/url"

	"github.com/IBM/sarama"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// PartitionLag is how far a consumer group is behind on one partition.
type PartitionLag struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	// Committed is the group's committed offset; -1 when it has none.
	Committed int64 `json:"committed"`
	// HighWater is the offset the next record will get.
	HighWater int64 `json:"high_water"`
	// Lag is HighWater - Committed, or the records retained in the
	// partition when the group has committed nothing.
	Lag int64 `json:"lag"`
}

// KafkaLag returns the lag of group on every partition of topics. sc may
// be nil (sarama.NewConfig with Version 2.8).
func KafkaLag(brokers []string, sc *sarama.Config, group string, topics []string) ([]PartitionLag, error) {
	if len(brokers) == 0 || group == "" || len(topics) == 0 {
		return nil, errors.New("inspect: kafka lag needs brokers, a group and topics")
	}
	if sc == nil {
		sc = sarama.NewConfig()
		sc.Version = sarama.V2_8_0_0
	}
	client, err := sarama.NewClient(brokers, sc)
	if err != nil {
		return nil, fmt.Errorf("inspect: connect to kafka: %w", err)
	}
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		return nil, fmt.Errorf("inspect: kafka admin: %w", err)
	}
	want := map[string][]int32{}
	for _, t := range topics {
		parts, err := client.Partitions(t)
		if err != nil {
			return nil, fmt.Errorf("inspect: topic %s: %w", t, err)
		}
		want[t] = parts
	}
	offsets, err := admin.ListConsumerGroupOffsets(group, want)
	if errors.Is(err, sarama.ErrGroupIDNotFound) {
		// A group that never committed does not exist yet: all is lag.
		offsets, err = &sarama.OffsetFetchResponse{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("inspect: offsets of group %s: %w", group, err)
	}
	var out []PartitionLag
	for _, t := range topics {
		for _, p := range want[t] {
			hwm, err := client.GetOffset(t, p, sarama.OffsetNewest)
			if err != nil {
				return nil, fmt.Errorf("inspect: %s/%d high-water mark: %w", t, p, err)
			}
			l := PartitionLag{Topic: t, Partition: p, Committed: -1, HighWater: hwm}
			if b := offsets.GetBlock(t, p); b != nil {
				if !errors.Is(b.Err, sarama.ErrNoError) {
					// Not "nothing committed": that is offset -1
					// without an error.
					return nil, fmt.Errorf("inspect: offset of group %s on %s/%d: %w", group, t, p, b.Err)
				}
				l.Committed = b.Offset
			}
			if l.Committed >= 0 {
				l.Lag = hwm - l.Committed
			} else {
				oldest, err := client.GetOffset(t, p, sarama.OffsetOldest)
				if err != nil {
					return nil, fmt.Errorf("inspect: %s/%d oldest offset: %w", t, p, err)
				}
				l.Lag = hwm - oldest
			}
			out = append(out, l)
		}
	}
	return out, nil
}

// QueueDepth is what RabbitMQ says of a queue.
type QueueDepth struct {
	Queue string `json:"queue"`
	// Ready counts messages waiting to be delivered (not those delivered
	// and unacked).
	Ready int `json:"ready"`
	// Consumers counts the queue's subscribers.
	Consumers int `json:"consumers"`
}

// AMQPDepth returns the depth of each queue, checked passively (nothing is
// declared). A missing queue is an error.
func AMQPDepth(amqpURL string, queues []string) ([]QueueDepth, error) {
	if _, err := amqp091.ParseURI(amqpURL); err != nil {
		// Not wrapped: the parser's error quotes the URL, password and
		// all.
		return nil, fmt.Errorf("inspect: RabbitMQ URL %s does not parse (a reserved character in the user name or password must be percent-encoded)", redact(amqpURL))
	}
	conn, err := amqp091.Dial(amqpURL)
	if err != nil {
		return nil, fmt.Errorf("inspect: connect to %s: %w", redact(amqpURL), err)
	}
	defer conn.Close()
	var out []QueueDepth
	for _, q := range queues {
		ch, err := conn.Channel()
		if err != nil {
			return nil, fmt.Errorf("inspect: open channel: %w", err)
		}
		st, err := ch.QueueDeclarePassive(q, false, false, false, false, nil)
		_ = ch.Close()
		if err != nil {
			return nil, fmt.Errorf("inspect: queue %s: %w", q, err)
		}
		out = append(out, QueueDepth{Queue: q, Ready: st.Messages, Consumers: st.Consumers})
	}
	return out, nil
}

func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparsable URL>"
	}
	return u.Redacted()
}
