package inspect

import (
	"context"
	"errors"
	"fmt"
	"net/url"

	"github.com/IBM/sarama"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceco/once/cmd/once/internal/cut"
	"github.com/onceco/once/cmd/once/internal/kafkawait"
	"github.com/onceco/once/internal/kafkaend"
	"github.com/onceco/once/internal/kafkarefusal"
)

// PartitionLag is how far a consumer group is behind on one partition.
type PartitionLag struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	// Committed is the group's committed offset; -1 when it has none.
	Committed int64 `json:"committed"`
	// HighWater is the offset a consumer reading committed records reads
	// up to: the partition's last stable offset, before the first record
	// of a transaction still open (the high-water mark when none is).
	HighWater int64 `json:"high_water"`
	// Lag is the offsets from the first record at or after Committed
	// (the partition's oldest offset when the group has committed
	// nothing) that a read-committed consumer is handed, to HighWater.
	// The transaction markers and aborted records before that record
	// are not counted, so a group caught up on a transactional topic
	// shows 0; those between records still to be read (and a marker
	// after the last) are, as in the Kafka Source's lag gauge.
	Lag int64 `json:"lag"`
}

// KafkaLag returns the lag of group on every partition of topics, as a
// consumer reading committed records (the Kafka Source's default) sees
// it: against each partition's last stable offset, so the records of
// open transactions are not counted, and from the first record the group
// will be handed, so the markers and aborted records it will pass are
// not either (a fetch or a few, read committed, per partition behind). sc may
// be nil: sarama.NewConfig with Version 2.8, and the bounds the once
// command sets by default (-kafka-timeout): the dial and each request
// wait 8s at most, and metadata is asked twice at most, so that a broker
// that accepts connections and never answers fails the call within about
// half a minute, with an error that says so (sarama's own defaults wait
// minutes). sc is copied, never modified. When ctx ends, the client's connections are closed: a call
// waiting on a broker that does not answer returns at once. A broker
// that refuses sc's TLS or SASL settings is returned as that refusal
// (naming the broker and what it refused), not as brokers unreachable.
func KafkaLag(ctx context.Context, brokers []string, sc *sarama.Config, group string, topics []string) ([]PartitionLag, error) {
	if len(brokers) == 0 || group == "" || len(topics) == 0 {
		return nil, errors.New("inspect: kafka lag needs brokers, a group and topics")
	}
	var c sarama.Config
	if sc != nil {
		c = *sc
	} else {
		c = *kafkawait.NewConfig()
	}
	stop := cut.Sarama(&c).On(ctx)
	defer stop()
	lag, err := kafkaLag(ctx, brokers, &c, group, topics)
	if err != nil && ctx.Err() != nil {
		return nil, ctx.Err()
	}
	if err != nil && sc == nil {
		return nil, kafkawait.Explain(err, kafkawait.Default, "KafkaLag's sarama configuration is nil")
	}
	return lag, err
}

func kafkaLag(ctx context.Context, brokers []string, sc *sarama.Config, group string, topics []string) ([]PartitionLag, error) {
	client, err := sarama.NewClient(brokers, sc)
	if err != nil {
		// A broker that refuses the TLS or SASL settings is said to,
		// not taken for brokers that are down.
		return nil, fmt.Errorf("inspect: connect to kafka: %w", kafkarefusal.Explain(ctx, brokers, sc, err))
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
			hwm, err := kafkaend.LastStableOffset(client, t, p)
			if err != nil {
				if err := client.RefreshMetadata(t); err != nil {
					return nil, fmt.Errorf("inspect: %s/%d last stable offset: %w", t, p, err)
				}
				if hwm, err = kafkaend.LastStableOffset(client, t, p); err != nil {
					return nil, fmt.Errorf("inspect: %s/%d last stable offset: %w", t, p, err)
				}
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
			from := l.Committed
			if from < 0 {
				if from, err = client.GetOffset(t, p, sarama.OffsetOldest); err != nil {
					return nil, fmt.Errorf("inspect: %s/%d oldest offset: %w", t, p, err)
				}
			}
			if from < hwm {
				from = kafkaend.FirstReadable(client, t, p, from, hwm)
			}
			l.Lag = max(hwm-from, 0)
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
// declared). A missing queue is an error. When ctx ends, the connection is
// closed: a call waiting on a broker that does not answer returns at once.
func AMQPDepth(ctx context.Context, amqpURL string, queues []string) ([]QueueDepth, error) {
	if _, err := amqp091.ParseURI(amqpURL); err != nil {
		// Not wrapped: the parser's error quotes the URL, password and
		// all.
		return nil, fmt.Errorf("inspect: RabbitMQ URL %s does not parse (a reserved character in the user name or password must be percent-encoded)", redact(amqpURL))
	}
	conn, cutter, err := cut.AMQP(ctx, amqpURL, nil)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("inspect: connect to %s: %w", redact(amqpURL), err)
	}
	stop := cutter.On(ctx)
	defer stop()
	defer conn.Close()
	depths, err := amqpDepth(conn, queues)
	if err != nil && ctx.Err() != nil {
		return nil, ctx.Err()
	}
	return depths, err
}

func amqpDepth(conn *amqp091.Connection, queues []string) ([]QueueDepth, error) {
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
