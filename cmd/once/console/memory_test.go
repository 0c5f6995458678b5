package console_test

import (
	"context"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"weak"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// keepingQueue counts, at the end of each read of the queue, the records
// of that read something still holds.
type keepingQueue struct {
	dlq.Queue
	kept atomic.Int64
}

func (q *keepingQueue) Browse(ctx context.Context, fn func(*dlq.Record) error) error {
	var read []weak.Pointer[dlq.Record]
	err := q.Queue.Browse(ctx, func(r *dlq.Record) error {
		read = append(read, weak.Make(r))
		return fn(r)
	})
	runtime.GC()
	n := 0
	for _, w := range read {
		if w.Value() != nil {
			n++
		}
	}
	q.kept.Store(int64(n))
	return err
}

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
	q := &keepingQueue{Queue: kq}
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, MaxRows: 5, Logger: testenv.Logger()})
	require.NoError(t, err)

	_, body := serve(t, h, "/dlq?q=0")
	assert.Contains(t, body, "5 of 60 records")
	assert.LessOrEqual(t, q.kept.Load(), int64(5), "the listing held every record it read")
	_, body = serve(t, h, "/")
	assert.Contains(t, body, "orders.dlq</a>: 60")
	assert.LessOrEqual(t, q.kept.Load(), int64(0), "the consumers page held every record it read")
}
