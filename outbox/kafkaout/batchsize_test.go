package kafkaout

import (
	"fmt"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/outbox"
)

// A topic whose max.message.bytes is below the producer's MaxMessageBytes
// refuses a batch of small records that together exceed it. Each record
// the topic would take alone is confirmed; only one that is too large on
// its own is refused, where every record of the refused batch was once
// refused (and the relay parked them all).
func TestTopicLimitBelowProducerLimitRefusesOnlyTooLargeRecords(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1))
	require.NoError(t, err)
	defer kf.Close()
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	admin, err := sarama.NewClusterAdmin(kf.ListenAddrs(), sc)
	require.NoError(t, err)
	limit := "10000"
	require.NoError(t, admin.CreateTopic("small", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"max.message.bytes": &limit}}, false))
	require.NoError(t, admin.Close())

	p, err := New(Config{Brokers: kf.ListenAddrs(), Sarama: sc})
	require.NoError(t, err)
	defer p.Close()
	var recs []outbox.Record
	for i := range 30 {
		body := make([]byte, 1000)
		if i == 20 {
			body = make([]byte, 20000)
		}
		recs = append(recs, outbox.Record{Seq: int64(i), EventID: fmt.Sprintf("e-%d", i), Topic: "small", Key: []byte("k"), Body: body})
	}
	errs := p.Publish(t.Context(), recs)
	require.Len(t, errs, len(recs))
	for i, err := range errs {
		switch {
		case i == 20:
			assert.True(t, outbox.IsRejected(err), "the record too large alone is refused: %v", err)
		case i < 20:
			assert.NoError(t, err, "record %d", i)
		default:
			assert.False(t, outbox.IsRejected(err), "record %d, behind the refused one, is not charged: %v", i, err)
		}
	}
}

// The largest record Check takes is taken by a topic whose
// max.message.bytes equals Producer.MaxMessageBytes (docs/outbox.md: keep
// the producer's limit at or below the topics'), and one byte more is
// refused by Check, before it is sent: the broker counts the record
// batch's header too, which sarama's size check leaves out.
func TestLargestRecordCheckTakesFitsATopicAtTheProducerLimit(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1))
	require.NoError(t, err)
	defer kf.Close()
	const limitBytes = 10000
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	sc.Producer.MaxMessageBytes = limitBytes
	admin, err := sarama.NewClusterAdmin(kf.ListenAddrs(), sc)
	require.NoError(t, err)
	limit := fmt.Sprint(limitBytes)
	require.NoError(t, admin.CreateTopic("t", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"max.message.bytes": &limit}}, false))
	require.NoError(t, admin.Close())
	p, err := New(Config{Brokers: kf.ListenAddrs(), Sarama: sc})
	require.NoError(t, err)
	defer p.Close()

	rec := outbox.Record{Seq: 1, EventID: "e-1", Topic: "t", Key: []byte("k"), Type: "x", Headers: map[string]string{"h": "v"}}
	for n := limitBytes - 200; ; n++ {
		rec.Body = make([]byte, n+1)
		if p.Check(rec) != nil {
			rec.Body = make([]byte, n)
			break
		}
	}
	require.NoError(t, p.Check(rec))
	assert.Nil(t, p.Publish(t.Context(), []outbox.Record{rec}), "the largest record Check takes is confirmed")
	rec.Body = append(rec.Body, 0)
	assert.True(t, outbox.IsRejected(p.Check(rec)), "a byte more is refused before it is sent")
}
