package console_test

import (
	"bytes"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// The page of a dead letter whose Kafka key, header names or header values
// are hundreds of kilobytes stays small, as with a huge payload: each shows
// its first 4 KiB and says that it is cut and how long it is. Short ones
// are shown whole, without the mark.
func TestRecordWithAHugeKeyOrHeaderStaysUsable(t *testing.T) {
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 1)
	const size = 200 << 10
	textKey := bytes.Repeat([]byte("customer-42/"), size/12+1)[:size]
	binKey := bytes.Repeat([]byte{0x00, 0xff}, size/2)
	bigValue := strings.Repeat("v", size)
	bigName := "x-" + strings.Repeat("n", size-2)
	for _, key := range [][]byte{textKey, binKey} {
		k.Produce(&sarama.ProducerMessage{Topic: "orders.dlq", Key: sarama.ByteEncoder(key), Value: sarama.StringEncoder("{}"),
			Headers: []sarama.RecordHeader{
				{Key: []byte(consumer.HeaderEventID), Value: []byte("ev-1")},
				{Key: []byte("x-big"), Value: []byte(bigValue)},
				{Key: []byte(bigName), Value: []byte("small")},
			}})
	}
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	cutMark := regexp.MustCompile(`class="cut"[^>]*>[^<]*first 4,096 of its 204,800 bytes`)
	for _, ref := range []string{"0:0", "0:1"} {
		html := get(t, srv.URL+"/record?q=0&ref="+ref)
		assert.Less(t, len(html), 64<<10, "%s: the page is %d bytes", ref, len(html))
		assert.Len(t, cutMark.FindAllString(html, -1), 3, "%s: the key, a header's value and a header's name are marked cut", ref)
		assert.Contains(t, html, "ev-1", "%s: short headers are shown", ref)
		assert.Contains(t, html, ">small<", "%s: a short value is shown whole", ref)
	}
	html := get(t, srv.URL+"/record?q=0&ref=0:0")
	assert.True(t, strings.Contains(html, string(textKey[:4096])), "the key's first 4 KiB are shown")
	assert.False(t, strings.Contains(html, string(textKey[:4097])), "only the key's first 4 KiB are shown")
	assert.True(t, strings.Contains(html, bigValue[:4096]), "the value's first 4 KiB are shown")
	assert.False(t, strings.Contains(html, bigValue[:4097]), "only the value's first 4 KiB are shown")
}
