package console_test

import (
	"html"
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

var hiddenInput = regexp.MustCompile(`<input type="hidden" name="([a-z]+)" value="([^"]*)">`)

// formOf returns the values of the hidden inputs of the page's forms.
func formOf(body string) url.Values {
	v := url.Values{}
	for _, m := range hiddenInput.FindAllStringSubmatch(body, -1) {
		v.Add(m[1], html.UnescapeString(m[2]))
	}
	return v
}

// post posts form to h's /replay as a browser of the console's own page
// would, and follows a replay's redirect to its result page.
func post(t *testing.T, h http.Handler, form url.Values) (int, string) {
	t.Helper()
	req := httptest.NewRequest(http.MethodPost, "/replay", strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code == http.StatusSeeOther {
		return serve(t, h, "/"+rec.Header().Get("Location"))
	}
	return rec.Code, rec.Body.String()
}

// A form names its dead-letter queue by its place in Config.Queues (q=1),
// and a Kafka ref ("0:0") is in every topic. A confirmation page left open
// while once ui was started again with its -dlq topics in another order
// (one added in front) replayed, once confirmed, the record at that ref
// in the topic now at that place: a dead letter nobody chose, put back
// to be handled. A form names its queue too, and one posted to a console
// whose queue at that place is another is refused.
func TestReplayFormOfAnotherQueueOrderIsRefused(t *testing.T) {
	k := testenv.NewKafka(t)
	for _, topic := range []string{"orders", "payments", "orders.dlq", "payments.dlq"} {
		k.CreateTopic(topic, 1)
	}
	queues := map[string]*countingQueue{}
	for _, topic := range []string{"orders", "payments"} {
		k.Produce(&sarama.ProducerMessage{Topic: topic + ".dlq", Value: sarama.StringEncoder(`{}`),
			Headers: []sarama.RecordHeader{
				{Key: []byte(consumer.HeaderEventID), Value: []byte(topic + "-1")},
				{Key: []byte(consumer.HeaderConsumer), Value: []byte("billing")},
				{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
				{Key: []byte(consumer.HeaderOriginalTopic), Value: []byte(topic)},
			}})
		q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: topic + ".dlq", Sarama: testenv.Sarama()})
		require.NoError(t, err)
		queues[topic] = &countingQueue{Queue: q}
	}
	before, err := console.New(console.Config{Queues: []dlq.Queue{queues["orders"], queues["payments"]}, AllowReplay: true,
		Logger: testenv.Logger()})
	require.NoError(t, err)
	code, confirmation := post(t, before, url.Values{"q": {"1"}, "ref": {"0:0"}})
	require.Equal(t, http.StatusOK, code, confirmation)
	require.Contains(t, confirmation, "payments-1")
	form := formOf(confirmation)
	require.Equal(t, "yes", form.Get("confirm"), confirmation)

	// Started again with a topic in front.
	after, err := console.New(console.Config{Queues: []dlq.Queue{queues["payments"], queues["orders"]}, AllowReplay: true,
		Logger: testenv.Logger()})
	require.NoError(t, err)
	code, body := post(t, after, form)
	assert.Equal(t, http.StatusConflict, code, "the form's queue is no longer at its place: %s", body)
	assert.NotContains(t, body, "orders-1", "the other topic's record at the ref")
	assert.Zero(t, queues["orders"].replays.Load(), "a record of another topic was replayed")
	assert.Zero(t, queues["payments"].replays.Load())

	// The console's own forms still replay.
	_, confirmation = post(t, after, url.Values{"q": {"0"}, "ref": {"0:0"}})
	code, body = post(t, after, formOf(confirmation))
	require.Equal(t, http.StatusOK, code, body)
	assert.Contains(t, body, "Replayed 1 of 1")
	assert.Contains(t, body, "payments-1")
}
