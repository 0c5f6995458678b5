package kafka

import (
	"context"
	"testing"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/conformance"
	"github.com/onceco/once/internal/pgtest"
)

func TestConformance(t *testing.T) { runConformance(t, 0) }

// With key lanes, records of different keys in one partition are handled
// concurrently and acked out of order; offsets are marked only over the
// settled prefix. The suite's order test checks the order per key.
func TestConformanceKeyLanes(t *testing.T) { runConformance(t, 4) }

func runConformance(t *testing.T, keyLanes int) {
	eachBroker(t, func(t *testing.T, kind brokerKind) { runConformanceOn(t, kind, keyLanes) })
}

func runConformanceOn(t *testing.T, kind brokerKind, keyLanes int) {
	conformance.Run(t, conformance.Suite{
		Features: conformance.Features{Ordered: true, FallbackID: true, RedeliverOnRestart: true},
		NewBroker: func(t *testing.T) conformance.Broker {
			c := newClusterOf(t, kind)
			b := &testBroker{c: c, topic: uniq("conf"), group: uniq("conf-group"), keyLanes: keyLanes}
			c.createTopic(b.topic, 3)
			c.createTopic(b.topic+DefaultDeadLetterSuffix, 1)
			sc := saramaConfig()
			sc.Producer.Return.Successes = true
			sc.Producer.RequiredAcks = sarama.WaitForAll
			p, err := sarama.NewSyncProducer(c.addrs, sc) // hash partitioner: one key, one partition
			require.NoError(t, err)
			t.Cleanup(func() { _ = p.Close() })
			b.producer = p
			return b
		},
		NewDB: func(t *testing.T) *pgxpool.Pool {
			pool, _ := pgtest.Schema(t)
			return pool
		},
	})
}

// testBroker is a conformance.Broker: one topic with three partitions, its
// dead-letter topic and one consumer group on a kfake or Apache Kafka
// cluster.
type testBroker struct {
	c        *cluster
	topic    string
	group    string
	producer sarama.SyncProducer
	keyLanes int
}

func (b *testBroker) Publish(_ context.Context, msgs ...conformance.OutMessage) error {
	out := make([]*sarama.ProducerMessage, 0, len(msgs))
	for _, m := range msgs {
		pm := &sarama.ProducerMessage{Topic: b.topic, Value: sarama.ByteEncoder(m.Value)}
		if m.Key != nil {
			pm.Key = sarama.ByteEncoder(m.Key)
		}
		if m.ID != "" {
			pm.Headers = append(pm.Headers, sarama.RecordHeader{Key: []byte("id"), Value: []byte(m.ID)})
		}
		if m.Type != "" {
			pm.Headers = append(pm.Headers, sarama.RecordHeader{Key: []byte("type"), Value: []byte(m.Type)})
		}
		for k, v := range m.Headers {
			pm.Headers = append(pm.Headers, sarama.RecordHeader{Key: []byte(k), Value: []byte(v)})
		}
		out = append(out, pm)
	}
	// One at a time, so that records of one key keep their order.
	for _, pm := range out {
		if _, _, err := b.producer.SendMessage(pm); err != nil {
			return err
		}
	}
	return nil
}

func (b *testBroker) NewSource(t *testing.T) consumer.Source {
	cfg := b.c.config(b.group, b.topic)
	cfg.KeyLanes = b.keyLanes
	s, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	return s
}

func (b *testBroker) DeadLetters(context.Context) ([]conformance.DeadLetterRecord, error) {
	recs, err := readTopic(b.c.addrs, b.topic+DefaultDeadLetterSuffix)
	if err != nil {
		return nil, err
	}
	out := make([]conformance.DeadLetterRecord, 0, len(recs))
	for _, r := range recs {
		h := make(map[string]string, len(r.Headers))
		for _, rh := range r.Headers {
			h[string(rh.Key)] = string(rh.Value)
		}
		out = append(out, conformance.DeadLetterRecord{Key: r.Key, Value: r.Value, Headers: h})
	}
	return out, nil
}
