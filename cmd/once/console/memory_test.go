package console_test

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"runtime"
	"strconv"
	"strings"
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

// heapQueue stores in Held, at the end of each read of the queue, how many
// bytes of heap the read left reachable: what the page that asked for it
// holds while it renders.
type heapQueue struct {
	dlq.Queue
	Held *atomic.Int64
}

func (q heapQueue) Browse(ctx context.Context, fn func(*dlq.Record) error) error {
	var m runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m)
	before := m.HeapAlloc
	err := q.Queue.Browse(ctx, fn)
	runtime.GC()
	runtime.ReadMemStats(&m)
	q.Held.Store(int64(m.HeapAlloc) - int64(before))
	return err
}

// A listing shows no payload, yet it held each of its rows' records whole,
// payload and key included (and, on Kafka, the fetch buffers they are
// slices of): a page of MaxRows (default 500) dead letters of 1 MB held
// half a gigabyte while it rendered, per queue and per tab. It holds what
// its rows show.
func TestListingDoesNotHoldThePayloadsOfItsRows(t *testing.T) {
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 1)
	const n, size = 40, 512 << 10
	for i := range n {
		k.Produce(&sarama.ProducerMessage{Topic: "orders.dlq", Key: sarama.StringEncoder("k-" + strconv.Itoa(i)),
			Value: sarama.ByteEncoder(bytes.Repeat([]byte{0, byte(i)}, size/2)),
			Headers: []sarama.RecordHeader{
				{Key: []byte(consumer.HeaderEventID), Value: []byte("e-" + strconv.Itoa(i))},
				{Key: []byte(consumer.HeaderConsumer), Value: []byte("billing")},
				{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
			}})
	}
	kq, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	var held atomic.Int64
	h, err := console.New(console.Config{Queues: []dlq.Queue{heapQueue{Queue: kq, Held: &held}}, MaxRows: n, Logger: testenv.Logger()})
	require.NoError(t, err)
	for _, page := range []string{"", "&last=1"} {
		code, body := serve(t, h, "/dlq?q=0"+page)
		require.Equal(t, http.StatusOK, code)
		assert.Contains(t, body, "records 1-40 of 40.", page)
		assert.Contains(t, body, ">e-39<", page)
		assert.Less(t, held.Load(), int64(n*size/4), "%q: the listing held %d bytes for %d payloads of %d bytes", page, held.Load(), n, size)
	}
	// The record's page, which shows the payload, still has it.
	_, body := serve(t, h, "/record?q=0&ref=0:39")
	assert.True(t, strings.Contains(body, "(524,288 bytes, hex)"), "the record's page shows its payload")
}

// The confirmation of a replay lists the selected records, no payload,
// yet it held each of them whole, as the listing did before it kept
// summaries: ticking the default 500 rows of 1 MB dead letters held half
// a gigabyte while the confirmation rendered. It holds what it shows; the
// replay, confirmed, reads its records anew.
func TestConfirmationDoesNotHoldThePayloadsOfItsRecords(t *testing.T) {
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 1)
	const n, size = 40, 512 << 10
	form := url.Values{"q": {"0"}}
	for i := range n {
		k.Produce(&sarama.ProducerMessage{Topic: "orders.dlq", Key: sarama.StringEncoder("k-" + strconv.Itoa(i)),
			Value: sarama.ByteEncoder(bytes.Repeat([]byte{0, byte(i)}, size/2)),
			Headers: []sarama.RecordHeader{
				{Key: []byte(consumer.HeaderEventID), Value: []byte("e-" + strconv.Itoa(i))},
				{Key: []byte(consumer.HeaderConsumer), Value: []byte("billing")},
				{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
				{Key: []byte(consumer.HeaderOriginalTopic), Value: []byte("orders")},
			}})
		form.Add("ref", "0:"+strconv.Itoa(i))
	}
	kq, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	var held atomic.Int64
	h, err := console.New(console.Config{Queues: []dlq.Queue{heapQueue{Queue: kq, Held: &held}}, AllowReplay: true,
		Logger: testenv.Logger()})
	require.NoError(t, err)
	req := httptest.NewRequest(http.MethodPost, "/replay", strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
	assert.Contains(t, rec.Body.String(), "Replay 40 records from kafka topic orders.dlq?")
	assert.Contains(t, rec.Body.String(), ">e-39<")
	assert.Less(t, held.Load(), int64(n*size/4), "the confirmation held %d bytes for %d payloads of %d bytes", held.Load(), n, size)
}
