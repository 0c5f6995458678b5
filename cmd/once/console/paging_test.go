package console_test

import (
	"context"
	"html"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/chromedp/chromedp"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

var (
	anyRef    = regexp.MustCompile(`data-ref="([^"]+)"`)
	countText = regexp.MustCompile(`<p class="muted" id="count">([^<]*)`)
)

// link returns the href of the page's link with the id, "" without one.
func link(body, id string) string {
	m := regexp.MustCompile(`id="` + id + `" href="([^"]*)"`).FindStringSubmatch(body)
	if m == nil {
		return ""
	}
	return html.UnescapeString(m[1])
}

// walk follows the next links from path and returns each page's body.
func walk(t *testing.T, h http.Handler, path string) []string {
	t.Helper()
	var bodies []string
	for path != "" {
		code, body := serve(t, h, path)
		require.Equal(t, http.StatusOK, code, "%s: %s", path, body)
		bodies = append(bodies, body)
		require.Less(t, len(bodies), 100, "the next links never end")
		if next := link(body, "next"); next != "" {
			path = "/" + next
		} else {
			path = ""
		}
	}
	return bodies
}

// refsOn returns the refs a page lists.
func refsOn(body string) []string {
	var refs []string
	for _, m := range anyRef.FindAllStringSubmatch(body, -1) {
		refs = append(refs, m[1])
	}
	return refs
}

// A dead-letter topic of more records than a page holds: the next links
// walk it page by page, each record on exactly one page, each page saying
// which records of how many it shows; the first, previous and last links
// go where they say; a filter is kept in every link and the pages hold
// what it selects; a cursor that is not one is refused (400) and a page
// past the end says so.
func TestDeadLettersPageThroughALargeTopic(t *testing.T) {
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 2)
	const n = 23
	var msgs []*sarama.ProducerMessage
	for i := range n {
		kind := "handler"
		if i%3 == 0 {
			kind = "panic"
		}
		msgs = append(msgs, &sarama.ProducerMessage{Topic: "orders.dlq", Key: sarama.StringEncoder("k-" + strconv.Itoa(i)),
			Value: sarama.StringEncoder(`{}`), Headers: []sarama.RecordHeader{
				{Key: []byte(consumer.HeaderEventID), Value: []byte("e-" + strconv.Itoa(i))},
				{Key: []byte(consumer.HeaderConsumer), Value: []byte("billing")},
				{Key: []byte(consumer.HeaderErrorKind), Value: []byte(kind)},
			}})
	}
	k.Produce(msgs...)
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	all, err := dlq.Collect(context.Background(), q, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, all, n)
	handlers, err := dlq.Collect(context.Background(), q, dlq.Filter{Kinds: []string{"handler"}, Consumer: "billing"})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, MaxRows: 5, Logger: testenv.Logger()})
	require.NoError(t, err)

	pages := walk(t, h, "/dlq?q=0")
	require.Equal(t, 5, len(pages), "pages")
	seen := map[string]int{}
	var order []string
	for i, body := range pages {
		refs := refsOn(body)
		from, to := i*5+1, min(i*5+5, n)
		assert.Len(t, refs, to-from+1, "page %d", i+1)
		assert.Equal(t, "records "+strconv.Itoa(from)+"-"+strconv.Itoa(to)+" of 23.",
			countText.FindStringSubmatch(body)[1])
		for _, r := range refs {
			seen[r]++
			order = append(order, r)
		}
	}
	var want []string
	for _, r := range all {
		want = append(want, r.Ref)
	}
	assert.Equal(t, want, order, "every record once, in the order of the read")
	for r, c := range seen {
		assert.Equal(t, 1, c, "record %s on %d pages", r, c)
	}
	first, last := pages[0], pages[4]
	assert.Empty(t, link(first, "prev"))
	assert.Empty(t, link(first, "first"))
	assert.Equal(t, "dlq?q=0&last=1", link(first, "last"))
	assert.Equal(t, "dlq?q=0&before="+url.QueryEscape(refsOn(last)[0]), link(last, "prev"))
	assert.Equal(t, "dlq?q=0", link(last, "first"))
	assert.Empty(t, link(last, "next"))
	assert.Empty(t, link(last, "last"))
	_, prev := serve(t, h, "/"+link(last, "prev"))
	assert.Equal(t, refsOn(pages[3]), refsOn(prev))
	assert.Contains(t, prev, "records 16-20 of 23.")
	// The last page is the last five records.
	_, body := serve(t, h, "/"+link(first, "last"))
	assert.Equal(t, order[18:], refsOn(body))
	assert.Contains(t, body, "records 19-23 of 23.")
	// Previous from the second page: the first page.
	_, body = serve(t, h, "/"+link(pages[1], "prev"))
	assert.Equal(t, refsOn(first), refsOn(body))
	assert.Empty(t, link(body, "prev"))

	// Filtered: every link keeps the filter, the pages hold what it selects.
	filtered := "/dlq?q=0&consumer=billing&kind=handler&id=e-*&search=billing&since="
	pages = walk(t, h, filtered)
	require.Equal(t, 3, len(pages), "pages") // 15 records
	order = nil
	for _, body := range pages {
		order = append(order, refsOn(body)...)
		for _, id := range []string{"next", "prev", "first", "last"} {
			if l := link(body, id); l != "" {
				v, err := url.ParseQuery(l[len("dlq?"):])
				require.NoError(t, err)
				assert.Equal(t, "billing", v.Get("consumer"), l)
				assert.Equal(t, "handler", v.Get("kind"), l)
				assert.Equal(t, "e-*", v.Get("id"), l)
				assert.Equal(t, "billing", v.Get("search"), l)
			}
		}
	}
	want = nil
	for _, r := range handlers {
		want = append(want, r.Ref)
	}
	assert.Equal(t, want, order)
	assert.Contains(t, pages[2], "records 11-15 of 15.")

	// Not a cursor: 400, as other bad input.
	for _, p := range []string{"last=0", "last=x", "after=0:1&before=0:2", "after=0:1&last=1"} {
		code, body := serve(t, h, "/dlq?q=0&"+p)
		assert.Equal(t, http.StatusBadRequest, code, p)
		assert.Contains(t, body, "last", p)
	}
	// Past the end (the records replayed since, say): an empty page that
	// says so and links back.
	lastRef := want[len(want)-1]
	for _, after := range []string{lastRef, "1:99999999"} {
		code, body := serve(t, h, "/dlq?q=0&kind=handler&after="+url.QueryEscape(after))
		assert.Equal(t, http.StatusOK, code, after)
		assert.Empty(t, refsOn(body), after)
		assert.Contains(t, body, "past the end", after)
		assert.Equal(t, "dlq?q=0&kind=handler&last=1", link(body, "last"), after)
		assert.Equal(t, "dlq?q=0&kind=handler", link(body, "first"), after)
	}
}

// Paging on a RabbitMQ dead-letter queue: every record on exactly one
// page; a replay of the records selected on the second page replays
// those, not the queue or the filter, and the pages then hold the rest.
func TestDeadLettersPageThroughOnRabbitMQ(t *testing.T) {
	u := testenv.AMQPURL(t)
	queue := testenv.Uniq("orders")
	testenv.DeleteQueues(t, u, queue, queue+".dlq")
	pool, _ := pgtest.Schema(t)
	svc := testenv.StartService(t, pool, testenv.OpenAMQPSource(t, u, queue), "billing")
	ch := testenv.AMQPChannel(t, u)
	ids := []string{"pay-1", "pay-2", "pay-3", "pay-4", "pay-5"}
	for i, id := range ids {
		testenv.PublishAMQP(t, ch, queue, amqp091.Publishing{MessageId: id, Body: testenv.JSON(i, "fail")})
	}
	svc.WaitSettled(t, 5)
	svc.Broken.Store(false)
	dl, err := dlq.NewAMQP(dlq.AMQPConfig{URL: u, Queue: queue + ".dlq"})
	require.NoError(t, err)
	h, err := console.New(console.Config{DB: svc.Pool, Queues: []dlq.Queue{dl}, AllowReplay: true, MaxRows: 2, Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	pages := walk(t, h, "/dlq?q=0")
	require.Equal(t, 3, len(pages), "pages")
	var listed []string // event ids
	var second []string // refs
	for i, body := range pages {
		for _, m := range dataRef.FindAllStringSubmatch(body, -1) {
			listed = append(listed, m[2])
			if i == 1 {
				second = append(second, m[1])
			}
		}
	}
	assert.ElementsMatch(t, ids, listed)
	assert.Len(t, listed, len(ids), "a record on two pages")
	assert.Contains(t, pages[1], "records 3-4 of 5.")
	assert.Contains(t, pages[1], "ticked on this page")

	resp, err := http.PostForm(srv.URL+"/replay", url.Values{"q": {"0"}, "ref": second, "confirm": {"yes"}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	svc.WaitSettled(t, 7)
	assert.Len(t, svc.Effects(t), 2, "the replay acted on the records of the page's selection only")

	pages = walk(t, h, "/dlq?q=0")
	require.Equal(t, 2, len(pages), "pages")
	var left []string
	for _, body := range pages {
		left = append(left, refsOn(body)...)
	}
	assert.Len(t, left, 3)
	assert.NotContains(t, left, second[0])
	assert.NotContains(t, left, second[1])
}

// In a real browser, one record a page: the count says which record of
// how many, the next and previous links walk a filtered view keeping its
// filter, and a record's link still opens it.
func TestDeadLetterPagesInBrowser(t *testing.T) {
	ctx := browser(t)
	_, q := deadLetters(t)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, MaxRows: 1, Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	step(t, ctx, chromedp.Navigate(srv.URL+"/dlq?q=0"), chromedp.WaitVisible(chromedp.CSS("#records")))
	assert.Equal(t, "records 1-1 of 4.", text(t, ctx, "#count"))
	step(t, ctx, chromedp.SetValue(chromedp.CSS("#kind"), "handler"), chromedp.Click(chromedp.CSS("#apply")))
	waitURL(t, ctx, "kind=handler")
	assert.Equal(t, "records 1-1 of 2.", text(t, ctx, "#count"))
	assert.Contains(t, text(t, ctx, "#records"), "fail-1")
	step(t, ctx, chromedp.Click(chromedp.CSS("#next")))
	waitURL(t, ctx, "after=")
	assert.Contains(t, text(t, ctx, "#count"), "records 2-2 of 2")
	assert.Contains(t, text(t, ctx, "#records"), "fail-2")
	assert.Equal(t, "handler", text(t, ctx, "#records .kind"), "the filter is kept")
	second, err := chromedp.Run(ctx, chromedp.Location())
	require.NoError(t, err)
	step(t, ctx, chromedp.Click(chromedp.CSS(`tr[data-event-id="fail-2"] a`)), chromedp.WaitVisible(chromedp.CSS("#facts")))
	assert.Equal(t, "fail-2", text(t, ctx, "#event-id"))
	step(t, ctx, chromedp.Navigate(second), chromedp.WaitVisible(chromedp.CSS("#prev")), chromedp.Click(chromedp.CSS("#prev")))
	require.Eventually(t, func() bool {
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		loc, err := chromedp.Run(sctx, chromedp.Location())
		return err == nil && !strings.Contains(loc, "after=")
	}, 30*time.Second, 20*time.Millisecond)
	assert.Contains(t, text(t, ctx, "#records"), "fail-1")
	assert.Contains(t, text(t, ctx, "#count"), "records 1-1 of 2")
}

// A replay from a page of a filtered listing leads back to that page: the
// confirmation's cancel link and the result's link to the dead letters
// keep the filter and the page. A way back to anywhere else is not taken.
func TestReplayFromAPageLeadsBackToIt(t *testing.T) {
	svc, q := deadLetters(t)
	h, err := console.New(console.Config{DB: svc.Pool, Queues: []dlq.Queue{q}, AllowReplay: true, MaxRows: 1, Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	const page = "dlq?q=0&kind=handler&after=0%3A0" // the second page: after fail-1

	body := get(t, srv.URL+"/"+page)
	m := regexp.MustCompile(`name="back" value="([^"]*)"`).FindStringSubmatch(body)
	require.NotNil(t, m, "the selection form carries no way back")
	back := html.UnescapeString(m[1])
	assert.Equal(t, page, back)
	refs := refsOn(body)
	require.Len(t, refs, 1)

	post := func(v url.Values) string {
		t.Helper()
		resp, err := http.PostForm(srv.URL+"/replay", v)
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return string(b)
	}
	confirm := post(url.Values{"q": {"0"}, "ref": refs, "back": {back}})
	assert.Equal(t, page, link(confirm, "cancel"))
	m = regexp.MustCompile(`name="back" value="([^"]*)"`).FindStringSubmatch(confirm)
	require.NotNil(t, m, "the confirmation carries no way back")
	assert.Equal(t, page, html.UnescapeString(m[1]))
	result := post(url.Values{"q": {"0"}, "ref": refs, "back": {back}, "confirm": {"yes"}})
	assert.Contains(t, result, "Replayed 1 of 1")
	assert.Equal(t, page, link(result, "back"))

	for _, elsewhere := range []string{"https://example.com/", "//example.com/dlq?q=0", "dlq?q=1", "record?q=0&ref=0:0", "javascript:alert(1)"} {
		confirm = post(url.Values{"q": {"0"}, "ref": refs, "back": {elsewhere}})
		assert.Equal(t, "dlq?q=0", link(confirm, "cancel"), elsewhere)
	}
}

// Dead letters that arrive while someone pages through a topic of two
// partitions (the newest of the first partition read before the second
// one) neither show a record on two pages nor skip one: each next link
// goes on after the last record of its page, wherever the read now puts
// it.
func TestNextPageWhileDeadLettersArrive(t *testing.T) {
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 2)
	rec := func(p int32, id string) *sarama.ProducerMessage {
		return &sarama.ProducerMessage{Topic: "orders.dlq", Partition: p, Value: sarama.StringEncoder(`{}`),
			Headers: []sarama.RecordHeader{
				{Key: []byte(consumer.HeaderEventID), Value: []byte(id)},
				{Key: []byte(consumer.HeaderConsumer), Value: []byte("billing")},
				{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
			}}
	}
	k.Produce(rec(0, "a-1"), rec(0, "a-2"), rec(0, "a-3"), rec(1, "b-1"), rec(1, "b-2"), rec(1, "b-3"))
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, MaxRows: 2, Logger: testenv.Logger()})
	require.NoError(t, err)

	ids := func(body string) []string {
		var out []string
		for _, m := range regexp.MustCompile(`data-event-id="([^"]*)"`).FindAllStringSubmatch(body, -1) {
			out = append(out, m[1])
		}
		return out
	}
	_, first := serve(t, h, "/dlq?q=0")
	require.Equal(t, []string{"a-1", "a-2"}, ids(first))
	_, second := serve(t, h, "/"+link(first, "next"))
	require.Equal(t, []string{"a-3", "b-1"}, ids(second))
	k.Produce(rec(0, "a-4")) // read before b-1 from now on
	_, third := serve(t, h, "/"+link(second, "next"))
	assert.Equal(t, []string{"b-2", "b-3"}, ids(third), "the page after b-1")
	assert.Contains(t, countText.FindStringSubmatch(third)[1], "records 6-7 of 7")
	assert.Empty(t, link(third, "next"))
	_, back := serve(t, h, "/"+link(third, "prev"))
	assert.Equal(t, []string{"a-4", "b-1"}, ids(back), "the page before b-2")
}

// Dead letters replayed from another tab while someone pages through a
// RabbitMQ queue do not make the next page skip the records that moved up:
// the next link goes on after the last record of its page.
func TestNextPageAfterRecordsBeforeItWereReplayedOnRabbitMQ(t *testing.T) {
	u := testenv.AMQPURL(t)
	queue := testenv.Uniq("orders")
	testenv.DeleteQueues(t, u, queue, queue+".dlq")
	pool, _ := pgtest.Schema(t)
	svc := testenv.StartService(t, pool, testenv.OpenAMQPSource(t, u, queue), "billing")
	ch := testenv.AMQPChannel(t, u)
	for i, id := range []string{"pay-1", "pay-2", "pay-3", "pay-4", "pay-5"} {
		testenv.PublishAMQP(t, ch, queue, amqp091.Publishing{MessageId: id, Body: testenv.JSON(i, "fail")})
	}
	svc.WaitSettled(t, 5)
	svc.Broken.Store(false)
	dl, err := dlq.NewAMQP(dlq.AMQPConfig{URL: u, Queue: queue + ".dlq"})
	require.NoError(t, err)
	h, err := console.New(console.Config{DB: svc.Pool, Queues: []dlq.Queue{dl}, AllowReplay: true, MaxRows: 2, Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	first := get(t, srv.URL+"/dlq?q=0")
	var order []string
	for _, body := range walk(t, h, "/dlq?q=0") {
		order = append(order, refsOn(body)...)
	}
	require.Len(t, order, 5)
	require.Equal(t, order[:2], refsOn(first))

	// Another tab replays the first record.
	resp, err := http.PostForm(srv.URL+"/replay", url.Values{"q": {"0"}, "ref": {order[0]}, "confirm": {"yes"}})
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)

	next := get(t, srv.URL+"/"+link(first, "next"))
	assert.Equal(t, order[2:4], refsOn(next), "the page after the second record")
	assert.Contains(t, countText.FindStringSubmatch(next)[1], "records 2-3 of 4")
	// The page after the replayed record: where it was is not known.
	gone := get(t, srv.URL+"/dlq?q=0&after="+order[0])
	assert.Empty(t, refsOn(gone))
	assert.Contains(t, gone, "no longer in the queue")
	assert.Equal(t, "dlq?q=0", link(gone, "first"))
	assert.Equal(t, "dlq?q=0&last=1", link(gone, "last"))
}

// Two messages of a RabbitMQ dead-letter queue alike to the byte (a
// message published twice into it) have the same ref: a page that ends
// with the first still leads to the second.
func TestPagesOfARabbitMQQueueWithTwinMessages(t *testing.T) {
	u := testenv.AMQPURL(t)
	queue := testenv.Uniq("orders.dlq")
	testenv.DeleteQueues(t, u, queue)
	ch := testenv.AMQPChannel(t, u)
	_, err := ch.QueueDeclare(queue, true, false, false, false, nil)
	require.NoError(t, err)
	msg := func(id string) amqp091.Publishing {
		return amqp091.Publishing{MessageId: id, Body: []byte(`{}`), Headers: amqp091.Table{
			consumer.HeaderEventID: id, consumer.HeaderConsumer: "billing", consumer.HeaderErrorKind: "handler",
		}}
	}
	for _, id := range []string{"x-1", "twin", "twin", "y-1"} {
		testenv.PublishAMQP(t, ch, queue, msg(id))
	}
	q, err := dlq.NewAMQP(dlq.AMQPConfig{URL: u, Queue: queue})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, MaxRows: 2, Logger: testenv.Logger()})
	require.NoError(t, err)

	var ids []string
	for _, body := range walk(t, h, "/dlq?q=0") {
		for _, m := range dataRef.FindAllStringSubmatch(body, -1) {
			ids = append(ids, m[2])
		}
	}
	assert.Equal(t, []string{"x-1", "twin", "twin", "y-1"}, ids)
}

// A replay of one record, asked from its page opened from a page of a
// filtered listing, leads back to that listing page, as a replay of a
// selection does: the record's link, its replay form, the confirmation's
// cancel link and the result's link keep the filter and the page.
func TestReplayOfOneRecordLeadsBackToItsListing(t *testing.T) {
	svc, q := deadLetters(t)
	h, err := console.New(console.Config{DB: svc.Pool, Queues: []dlq.Queue{q}, AllowReplay: true, MaxRows: 1, Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	const page = "dlq?q=0&kind=handler&after=0%3A0" // the second page: after fail-1

	listing := get(t, srv.URL+"/"+page)
	m := regexp.MustCompile(`<a href="(record\?[^"]*)"`).FindStringSubmatch(listing)
	require.NotNil(t, m, "no link to the record")
	rec := get(t, srv.URL+"/"+html.UnescapeString(m[1]))
	require.Contains(t, rec, `id="replay-one"`)
	assert.Equal(t, page, link(rec, "back"), "the record page's link back")
	form := url.Values{}
	for _, in := range regexp.MustCompile(`<input type="hidden" name="([^"]*)" value="([^"]*)">`).FindAllStringSubmatch(rec, -1) {
		form.Add(in[1], html.UnescapeString(in[2]))
	}
	require.NotEmpty(t, form.Get("ref"))

	post := func(v url.Values) string {
		t.Helper()
		resp, err := http.PostForm(srv.URL+"/replay", v)
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return string(b)
	}
	confirm := post(form)
	assert.Equal(t, page, link(confirm, "cancel"), "the confirmation's cancel link")
	form.Set("confirm", "yes")
	result := post(form)
	assert.Contains(t, result, "Replayed 1 of 1")
	assert.Equal(t, page, link(result, "back"), "the result's link to the dead letters")

	// A way back to anywhere else is not offered on the record's page.
	rec = get(t, srv.URL+"/record?q=0&ref="+url.QueryEscape(form.Get("ref"))+"&back="+url.QueryEscape("https://example.com/"))
	assert.NotContains(t, rec, "example.com")
	assert.Equal(t, "dlq?q=0", link(rec, "back"))
}
