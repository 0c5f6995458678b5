package console_test

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
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

// The fields the pages summarize from a dead letter's headers (the event
// id, the event type, the error, the consumer, where it goes back to) are
// cut like the headers themselves. A record not written by a consumer of
// this library may carry any of them as large as the record: the record's
// page cut the header table to 4 KiB a field but showed the same headers
// whole in its summary, and the listing and the replay's confirmation
// showed them whole in every row, so one such record made each page as
// large as its headers (and a page of 500 of them hundreds of megabytes),
// as `once dlq show` no longer does (TestShowCutsAHugeKeyOrHeader).
func TestPagesCutHugeSummaryFields(t *testing.T) {
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 1)
	const size = 100 << 10
	big := func(prefix string) []byte { return []byte(prefix + strings.Repeat("x", size-len(prefix))) }
	k.Produce(&sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.StringEncoder("{}"),
		Headers: []sarama.RecordHeader{
			{Key: []byte(consumer.HeaderEventID), Value: big("id-")},
			{Key: []byte(consumer.HeaderEventType), Value: big("type-")},
			{Key: []byte(consumer.HeaderErrorMessage), Value: big("error-")},
			{Key: []byte(consumer.HeaderConsumer), Value: big("consumer-")},
			{Key: []byte(consumer.HeaderOriginalTopic), Value: big("topic-")},
			{Key: []byte(consumer.HeaderErrorKind), Value: big("kind-")},
		}})
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, AllowReplay: true, Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	pages := map[string]string{
		"record":  get(t, srv.URL+"/record?q=0&ref=0:0"),
		"listing": get(t, srv.URL+"/dlq?q=0"),
	}
	resp, err := http.PostForm(srv.URL+"/replay", url.Values{"q": {"0"}, "ref": {"0:0"}})
	require.NoError(t, err)
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	pages["confirmation"] = string(b)
	for name, html := range pages {
		// (In a bool: testify would print the page.)
		assert.Less(t, len(html), 64<<10, "%s: the page is %d bytes", name, len(html))
		assert.False(t, strings.Contains(html, strings.Repeat("x", 4097)), "%s: a field is shown past its first 4 KiB", name)
	}
	assert.True(t, strings.Contains(pages["record"], "error-"+strings.Repeat("x", 100)), "the record's error is shown")
	assert.True(t, strings.Contains(pages["record"], "first 4,096 of its 102,400 bytes"), "the record's page says a field is cut")
	// The consumers page links to the listing of each consumer and kind,
	// whose filter needs them whole; it shows their first 4 KiB.
	overview := get(t, srv.URL+"/")
	for _, f := range []string{"consumer-", "kind-"} {
		assert.False(t, strings.Contains(overview, ">"+f+strings.Repeat("x", 4097)), "overview: the %s is shown past its first 4 KiB", f)
		assert.True(t, strings.Contains(overview, ">"+f+strings.Repeat("x", 100)), "overview: the %s is shown", f)
	}
}
