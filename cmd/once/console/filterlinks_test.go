package console_test

import (
	"html"
	"net/http"
	"regexp"
	"strings"
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

// foreignDeadLetters is a console on a dead-letter topic holding, in
// order: pay-1 (billing, handler), pay-2 (billing, no kind), pay-3 (no
// consumer, no kind: written by another producer), pay-4 (billing, a kind
// this console does not know) and pay-5 (billing, handler).
func foreignDeadLetters(t *testing.T, failedAt time.Time) http.Handler {
	t.Helper()
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 1)
	for _, r := range []struct{ id, consumer, kind string }{
		{"pay-1", "billing", "handler"}, {"pay-2", "billing", ""}, {"pay-3", "", ""},
		{"pay-4", "billing", "quota-exceeded"}, {"pay-5", "billing", "handler"},
	} {
		hs := []sarama.RecordHeader{
			{Key: []byte(consumer.HeaderEventID), Value: []byte(r.id)},
			{Key: []byte(consumer.HeaderFailedAt), Value: []byte(failedAt.Format(time.RFC3339Nano))},
		}
		if r.consumer != "" {
			hs = append(hs, sarama.RecordHeader{Key: []byte(consumer.HeaderConsumer), Value: []byte(r.consumer)})
		}
		if r.kind != "" {
			hs = append(hs, sarama.RecordHeader{Key: []byte(consumer.HeaderErrorKind), Value: []byte(r.kind)})
		}
		k.Produce(&sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.StringEncoder(`{}`), Headers: hs})
	}
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, Logger: testenv.Logger()})
	require.NoError(t, err)
	return h
}

var summaryRow = regexp.MustCompile(`(?s)<tr><td><a href="([^"]*)">(.*?)</a></td>\s*<td><a href="([^"]*)">.*?>([^<]*)</span></a>`)

// listed returns the event ids on the listing at path.
func listed(t *testing.T, h http.Handler, path string) []string {
	t.Helper()
	code, body := serve(t, h, path)
	require.Equal(t, http.StatusOK, code, body)
	var ids []string
	for _, m := range regexp.MustCompile(`data-event-id="([^"]*)"`).FindAllStringSubmatch(body, -1) {
		ids = append(ids, m[1])
	}
	return ids
}

// The consumers page counts dead letters by consumer and kind, each count
// linking to its records. A row of records with no consumer, or no kind,
// linked to "consumer=" or "kind=", an empty filter, which selects every
// record: the row of 1 record without a consumer led to all 5 dead
// letters, that of billing's record without a kind to every one of
// billing's. Each row now leads to its records.
func TestSummaryRowsWithoutAConsumerOrKindLinkToTheirRecords(t *testing.T) {
	h := foreignDeadLetters(t, time.Now().Add(-time.Minute))
	_, body := serve(t, h, "/")
	rows := summaryRow.FindAllStringSubmatch(body, -1)
	require.Len(t, rows, 4, body)
	byConsumer, byKind := map[string][]string{}, map[string][]string{}
	for _, m := range rows {
		row := m[2] + "/" + m[4]
		byConsumer[row] = listed(t, h, "/"+html.UnescapeString(m[1]))
		byKind[row] = listed(t, h, "/"+html.UnescapeString(m[3]))
	}
	assert.Equal(t, []string{"pay-3"}, byConsumer["-/-"], "the consumer link of the row without a consumer")
	assert.Equal(t, []string{"pay-3"}, byKind["-/-"], "the kind link of the row without a consumer or kind")
	assert.Equal(t, []string{"pay-2"}, byKind["billing/-"], "the kind link of billing's row without a kind")
	assert.Equal(t, []string{"pay-1", "pay-2", "pay-4", "pay-5"}, byConsumer["billing/-"])
	assert.Equal(t, []string{"pay-1", "pay-5"}, byKind["billing/handler"])
	assert.Equal(t, []string{"pay-4"}, byKind["billing/quota-exceeded"])

	// The listing's form keeps the choice, and its page links too.
	_, page := serve(t, h, "/dlq?q=0&nokind=1")
	assert.True(t, strings.Contains(page, `name="nokind" value="1" id="nokind" checked`), "the form's none box for the kind")
	assert.Equal(t, http.StatusBadRequest, func() int { c, _ := serve(t, h, "/dlq?q=0&kind=handler&nokind=1"); return c }())
}

// The listing's kind drop-down offered the kinds of this library only. A
// dead letter of another kind (written by another producer, or a later
// version) could not be chosen; and a listing opened from the consumers
// page's link for that kind showed "any" in the drop-down, so sending
// the form again (to search within it) dropped the kind and listed every
// record. The drop-down offers the kinds met in the read and the
// filter's own.
func TestKindDropDownOffersKindsItDoesNotKnow(t *testing.T) {
	h := foreignDeadLetters(t, time.Now().Add(-time.Minute))
	_, page := serve(t, h, "/dlq?q=0")
	assert.True(t, strings.Contains(page, `<option value="quota-exceeded">quota-exceeded</option>`), "a kind met in the read")
	_, page = serve(t, h, "/dlq?q=0&kind=quota-exceeded")
	assert.True(t, strings.Contains(page, `<option value="quota-exceeded" selected>quota-exceeded</option>`),
		"the listing's own kind is not its drop-down's choice: sent again, the form lists every kind")
	_, page = serve(t, h, "/dlq?q=0&kind=never-seen")
	assert.True(t, strings.Contains(page, `<option value="never-seen" selected>never-seen</option>`),
		"a kind of no record is still the filter's")
}

// "ago" beside a time was time.Since rounded: a time ahead of the
// console's clock (the consumer's host clock ahead of the console's)
// read as "-59m59s ago". It says the time is ahead.
func TestAgoOfATimeAheadOfTheConsoleClock(t *testing.T) {
	h := foreignDeadLetters(t, time.Now().Add(time.Hour))
	for _, page := range []string{"/", "/record?q=0&ref=0:0"} {
		_, body := serve(t, h, page)
		assert.False(t, strings.Contains(body, "s ago"), "%s: a time ahead of the clock as a time ago: %s", page,
			regexp.MustCompile(`-?[0-9hms.]+ ago`).FindString(body))
		// An hour ahead when the record was written, a little less by
		// the time the page is read: rounded to the second, either.
		assert.Regexp(t, `(1h0m0s|59m[0-9]+s) ahead of this clock`, body, page)
	}
}
