package console_test

import (
	"html"
	"net/http"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// consoleOn is a console on a dead-letter topic of kfake holding one
// handler dead letter per id with the consumer beside it ("": no
// once-consumer header), each failed a minute ago.
func consoleOn(t *testing.T, recs ...[2]string) http.Handler {
	t.Helper()
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 1)
	failedAt := time.Now().Add(-time.Minute).Format(time.RFC3339Nano)
	for _, r := range recs {
		hs := []sarama.RecordHeader{
			{Key: []byte(consumer.HeaderEventID), Value: []byte(r[0])},
			{Key: []byte(consumer.HeaderErrorKind), Value: []byte(consumer.KindHandler)},
			{Key: []byte(consumer.HeaderFailedAt), Value: []byte(failedAt)},
		}
		if r[1] != "" {
			hs = append(hs, sarama.RecordHeader{Key: []byte(consumer.HeaderConsumer), Value: []byte(r[1])})
		}
		k.Produce(&sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.StringEncoder(`{}`), Headers: hs})
	}
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, Logger: testenv.Logger()})
	require.NoError(t, err)
	return h
}

// A consumer named "-" was shown as "-", the mark of no consumer: on the
// consumers page its row and the row of records without a consumer read
// alike, and so did its records on the listing and their pages.
func TestConsumerNamedDashIsNotShownAsNoConsumer(t *testing.T) {
	h := consoleOn(t, [2]string{"pay-1", "-"}, [2]string{"pay-2", ""})
	_, body := serve(t, h, "/")
	rows := summaryRow.FindAllStringSubmatch(body, -1)
	require.Len(t, rows, 2, body)
	names := map[string]string{}
	for _, m := range rows {
		names[html.UnescapeString(m[1])] = html.UnescapeString(m[2])
	}
	assert.Equal(t, `"-"`, names["dlq?q=0&consumer=-"], "the row of the consumer named -")
	assert.Equal(t, "-", names["dlq?q=0&noconsumer=1"], "the row without a consumer")

	for path, want := range map[string]string{"/record?q=0&ref=0:0": `<dd>"-"</dd>`, "/record?q=0&ref=0:1": `<dd>-</dd>`} {
		code, page := serve(t, h, path)
		require.Equal(t, http.StatusOK, code, page)
		assert.Contains(t, html.UnescapeString(page), "<dt>Consumer</dt>"+want, path)
	}
}

// An event id that ends in a star could not be chosen alone on the
// listing: id=sku* is the prefix. A backslash before the star makes it
// the id's, as in once dlq.
func TestListingSelectsAnIDEndingInAStarExactly(t *testing.T) {
	h := consoleOn(t, [2]string{"sku*", "billing"}, [2]string{"sku*-2", "billing"}, [2]string{"sku-3", "billing"})
	assert.Equal(t, []string{"sku*"}, listed(t, h, `/dlq?q=0&id=sku%5C*`))
	assert.Equal(t, []string{"sku*", "sku*-2", "sku-3"}, listed(t, h, "/dlq?q=0&id=sku*"))
}
