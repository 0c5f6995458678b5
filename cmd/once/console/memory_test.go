package console_test

import (
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// A page over a large dead-letter topic holds the records it shows, not
// every record of the topic with its payload: the listing keeps its
// MaxRows rows and counts the rest, the consumers page counts them all
// and keeps none.
func TestPagesDoNotHoldEveryRecordOfALargeTopic(t *testing.T) {
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 1)
	const n = 60
	var msgs []*sarama.ProducerMessage
	for i := range n {
		msgs = append(msgs, &sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.ByteEncoder(make([]byte, 4096)),
			Headers: []sarama.RecordHeader{
				{Key: []byte(consumer.HeaderEventID), Value: []byte("e-" + strconv.Itoa(i))},
				{Key: []byte(consumer.HeaderConsumer), Value: []byte("billing")},
				{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
			}})
	}
	k.Produce(msgs...)
	kq, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	var kept atomic.Int64
	q := testenv.KeepingQueue{Queue: kq, Kept: &kept}
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, MaxRows: 5, Logger: testenv.Logger()})
	require.NoError(t, err)

	_, body := serve(t, h, "/dlq?q=0")
	assert.Contains(t, body, "records 1-5 of 60.")
	assert.LessOrEqual(t, kept.Load(), int64(5), "the listing held every record it read")
	for _, page := range []string{"after=0%3A20", "before=0%3A40", "last=1"} {
		_, body = serve(t, h, "/dlq?q=0&"+page)
		assert.Contains(t, body, "records ", page)
		assert.LessOrEqual(t, kept.Load(), int64(5), "%s: the listing held more records than its page", page)
	}
	_, body = serve(t, h, "/")
	assert.Contains(t, body, "orders.dlq</a>: 60")
	assert.LessOrEqual(t, kept.Load(), int64(0), "the consumers page held every record it read")
}
