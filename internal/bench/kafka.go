package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/kafkatemp"
)

// kafkaCluster is a Kafka cluster spoken to over TCP by sarama exactly as
// the adapter does in production: in-process kfake, or Apache Kafka.
type kafkaCluster struct {
	kf    *kfake.Cluster     // Kafka (kfake)
	real  *kafkatemp.Cluster // ApacheKafka
	addrs []string
}

// startKafka starts the cluster of broker kind b. Apache Kafka runs with
// the JVM's optimising compiler and a 512 MB heap, as a benchmark should,
// its files in dir (empty: the system's temporary directory).
func startKafka(ctx context.Context, b Broker, dir string) (*kafkaCluster, error) {
	if b == ApacheKafka {
		c, err := kafkatemp.Start(ctx, kafkatemp.Options{FullJIT: true, HeapMB: 512, Dir: dir})
		if err != nil {
			return nil, err
		}
		return &kafkaCluster{real: c, addrs: c.Brokers()}, nil
	}
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(200*time.Millisecond))
	if err != nil {
		return nil, fmt.Errorf("kfake: %w", err)
	}
	return &kafkaCluster{kf: kf, addrs: kf.ListenAddrs()}, nil
}

func (c *kafkaCluster) Close() {
	if c.real != nil {
		_ = c.real.Close()
		return
	}
	c.kf.Close()
}

func saramaConfig() *sarama.Config {
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	sc.Metadata.Retry.Backoff = 50 * time.Millisecond
	sc.Consumer.Retry.Backoff = 50 * time.Millisecond
	sc.Producer.Retry.Backoff = 50 * time.Millisecond
	return sc
}

// createTopics creates topic with the given partitions and its dead-letter
// topic with one.
func (c *kafkaCluster) createTopics(topic string, partitions int) error {
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	if err != nil {
		return err
	}
	defer admin.Close()
	if err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: int32(partitions), ReplicationFactor: 1}, false); err != nil {
		return err
	}
	if err := admin.CreateTopic(topic+kafka.DefaultDeadLetterSuffix, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false); err != nil {
		return err
	}
	return c.awaitLeaders(topic, int32(partitions))
}

// awaitLeaders waits until every partition of topic has a leader: Apache
// Kafka creates topics asynchronously.
func (c *kafkaCluster) awaitLeaders(topic string, partitions int32) error {
	client, err := sarama.NewClient(c.addrs, saramaConfig())
	if err != nil {
		return err
	}
	defer client.Close()
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := client.RefreshMetadata(topic)
		if err == nil {
			var parts []int32
			if parts, err = client.Partitions(topic); err == nil && int32(len(parts)) == partitions {
				for _, p := range parts {
					if _, err = client.Leader(topic, p); err != nil {
						break
					}
				}
				if err == nil {
					return nil
				}
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("topic %s has no leaders after 30 s: %w", topic, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func kafkaRecord(topic string, m Msg, produced time.Time) *sarama.ProducerMessage {
	h := []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(m.ID)}}
	if !produced.IsZero() {
		h = append(h, sarama.RecordHeader{Key: []byte(HeaderProduced), Value: []byte(strconv.FormatInt(produced.UnixNano(), 10))})
	}
	return &sarama.ProducerMessage{Topic: topic, Partition: m.Partition, Key: sarama.StringEncoder(m.ID), Value: sarama.ByteEncoder(m.Value), Headers: h}
}

// produceBacklog writes the workload to topic before the row starts.
func produceBacklog(addrs []string, topic, prefix string, w Workload) error {
	sc := saramaConfig()
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForLocal
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	p, err := sarama.NewSyncProducer(addrs, sc)
	if err != nil {
		return err
	}
	const chunk = 5000
	batch := make([]*sarama.ProducerMessage, 0, chunk)
	var sendErr error
	flush := func() {
		if len(batch) > 0 && sendErr == nil {
			sendErr = p.SendMessages(batch)
		}
		batch = batch[:0]
	}
	w.Each(prefix, func(m Msg) bool {
		batch = append(batch, kafkaRecord(topic, m, time.Time{}))
		if len(batch) == chunk {
			flush()
		}
		return sendErr == nil
	})
	flush()
	if err := p.Close(); sendErr == nil {
		sendErr = err
	}
	return sendErr
}

// topicCount returns the number of records in topic (all partitions).
func topicCount(addrs []string, topic string) (int, error) {
	client, err := sarama.NewClient(addrs, saramaConfig())
	if err != nil {
		return 0, err
	}
	defer client.Close()
	parts, err := client.Partitions(topic)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, p := range parts {
		hwm, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, err
		}
		n += int(hwm)
	}
	return n, nil
}

// openKafkaSource opens the adapter's source on the row's topic.
func openKafkaSource(ctx context.Context, spec *rowSpec, logger *slog.Logger) (consumer.Source, error) {
	return kafka.Open(ctx, kafka.Config{
		Brokers:           spec.Brokers,
		Group:             spec.Group,
		Topics:            []string{spec.Topic},
		SessionTimeout:    3 * time.Second,
		HeartbeatInterval: 300 * time.Millisecond,
		RebalanceTimeout:  10 * time.Second,
		RevokeTimeout:     5 * time.Second,
		KeyLanes:          spec.KeyLanes,
		Sarama:            saramaConfig(),
		Logger:            logger,
	})
}

// pacerLinger is how long the paced phase's producer gathers records into
// one produce request (sarama's Producer.Flush.Frequency): 5 ms, the
// default linger.ms of Apache Kafka's own producer from 4.0 on (KIP-1030)
// and of librdkafka from 1.5. With sarama's default of none, a paced
// stream of a few thousand records a second became as many tiny produce
// requests, which took the Apache Kafka broker's JVM about a core of the
// two the consumer and PostgreSQL share, and made the tail of the
// slower rows the bench's own producer's (docs/performance.md). A
// record's stamp is taken before it waits, so the linger counts in its
// produce-to-ack latency.
const pacerLinger = 5 * time.Millisecond

// kafkaPacer produces paced messages with an asynchronous producer,
// stamping each with its produce time.
type kafkaPacer struct {
	p     sarama.AsyncProducer
	topic string
	errs  chan error
}

func newKafkaPacer(spec *rowSpec) (*kafkaPacer, error) {
	sc := saramaConfig()
	sc.Producer.RequiredAcks = sarama.WaitForLocal
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	sc.Producer.Return.Errors = true
	sc.Producer.Flush.Frequency = pacerLinger
	p, err := sarama.NewAsyncProducer(spec.Brokers, sc)
	if err != nil {
		return nil, err
	}
	k := &kafkaPacer{p: p, topic: spec.Topic, errs: make(chan error, 1)}
	go func() {
		var first error
		for e := range p.Errors() {
			if first == nil {
				first = e
			}
		}
		k.errs <- first
	}()
	return k, nil
}

func (k *kafkaPacer) send(m Msg) error {
	k.p.Input() <- kafkaRecord(k.topic, m, time.Now())
	return nil
}

// Close flushes the producer and returns the first produce error.
func (k *kafkaPacer) Close() error {
	k.p.AsyncClose()
	return <-k.errs
}

// uncommitted returns how many records of topic lie beyond group's
// committed offsets.
func uncommitted(addrs []string, group, topic string) (int, error) {
	client, err := sarama.NewClient(addrs, saramaConfig())
	if err != nil {
		return 0, err
	}
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		return 0, err
	}
	parts, err := client.Partitions(topic)
	if err != nil {
		return 0, err
	}
	resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: parts})
	if errors.Is(err, sarama.ErrGroupIDNotFound) {
		resp, err = &sarama.OffsetFetchResponse{}, nil // the group never committed
	}
	if err != nil {
		return 0, err
	}
	n := 0
	for _, p := range parts {
		hwm, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, err
		}
		committed := int64(0)
		if b := resp.GetBlock(topic, p); b != nil && b.Err == sarama.ErrNoError && b.Offset > 0 {
			committed = b.Offset
		}
		n += int(hwm - committed)
	}
	return n, nil
}

// topicIDs returns the id of every record of topic, all partitions: its
// id header, or its key when it has none.
func topicIDs(addrs []string, topic string) ([]string, error) {
	sc := saramaConfig()
	// Closing the consumer waits for its fetch in flight, which the broker
	// holds this long when the partition has nothing more.
	sc.Consumer.MaxWaitTime = 10 * time.Millisecond
	client, err := sarama.NewClient(addrs, sc)
	if err != nil {
		return nil, err
	}
	defer client.Close()
	cons, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return nil, err
	}
	defer cons.Close()
	parts, err := client.Partitions(topic)
	if err != nil {
		return nil, err
	}
	var ids []string
	for _, p := range parts {
		oldest, err := client.GetOffset(topic, p, sarama.OffsetOldest)
		if err != nil {
			return nil, err
		}
		newest, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return nil, err
		}
		if newest <= oldest {
			continue
		}
		if ids, err = readPartitionIDs(cons, topic, p, oldest, newest, ids); err != nil {
			return nil, err
		}
	}
	return ids, nil
}

// readPartitionIDs appends to ids those of partition p's records from
// offset from up to to.
func readPartitionIDs(cons sarama.Consumer, topic string, p int32, from, to int64, ids []string) ([]string, error) {
	pc, err := cons.ConsumePartition(topic, p, from)
	if err != nil {
		return nil, err
	}
	defer pc.Close()
	timeout := time.NewTimer(time.Minute)
	defer timeout.Stop()
	for next := from; next < to; {
		select {
		case m := <-pc.Messages():
			id := string(m.Key)
			for _, h := range m.Headers {
				if string(h.Key) == "id" {
					id = string(h.Value)
				}
			}
			ids, next = append(ids, id), m.Offset+1
		case err := <-pc.Errors():
			return nil, err
		case <-timeout.C:
			return nil, fmt.Errorf("%s/%d: offsets %d to %d not read in a minute", topic, p, next, to)
		}
	}
	return ids, nil
}
