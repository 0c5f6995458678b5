package console_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/internal/pgtest"
)

var dataRef = regexp.MustCompile(`data-ref="([0-9a-f]+)" data-event-id="([^"]*)"`)

// The console on a RabbitMQ dead-letter queue: the records listed by their
// digest refs, two of three replayed (posted twice, as a double click
// would), one effect each, and only the third left in the queue.
func TestConsoleReplayOnRabbitMQ(t *testing.T) {
	u := testenv.AMQPURL(t)
	queue := testenv.Uniq("orders")
	testenv.DeleteQueues(t, u, queue, queue+".dlq")
	pool, _ := pgtest.Schema(t)
	svc := testenv.StartService(t, pool, testenv.OpenAMQPSource(t, u, queue), "billing")
	ch := testenv.AMQPChannel(t, u)
	for _, id := range []string{"pay-1", "pay-2", "pay-3"} {
		testenv.PublishAMQP(t, ch, queue, amqp091.Publishing{MessageId: id, Body: testenv.JSON(1, "fail")})
	}
	svc.WaitSettled(t, 3)
	svc.Broken.Store(false)
	dl, err := dlq.NewAMQP(dlq.AMQPConfig{URL: u, Queue: queue + ".dlq"})
	require.NoError(t, err)
	q := &countingQueue{Queue: dl}
	h, err := console.New(console.Config{DB: svc.Pool, Queues: []dlq.Queue{q}, AllowReplay: true, Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	refs := map[string]string{} // event id -> ref
	for _, m := range dataRef.FindAllStringSubmatch(get(t, srv.URL+"/dlq?q=0"), -1) {
		refs[m[2]] = m[1]
	}
	require.Len(t, refs, 3)
	assert.Contains(t, get(t, srv.URL+"/record?q=0&ref="+refs["pay-1"]), "pay-1")

	form := url.Values{"q": {"0"}, "ref": {refs["pay-1"], refs["pay-2"]}}
	resp, err := http.PostForm(srv.URL+"/replay", form)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Zero(t, q.replays.Load(), "the confirmation page replays nothing")
	assert.Empty(t, svc.Effects(t), "the confirmation page replays nothing")

	form.Set("confirm", "yes")
	for range 2 {
		resp, err = http.PostForm(srv.URL+"/replay", form)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	assert.Equal(t, int32(2), q.replays.Load(), "each confirmed post asks for a replay; the second finds the records gone")
	svc.WaitSettled(t, 5)
	assert.Equal(t, map[string]int{"pay-1": 1, "pay-2": 1}, svc.Effects(t))
	left := dataRef.FindAllStringSubmatch(get(t, srv.URL+"/dlq?q=0"), -1)
	require.Len(t, left, 1)
	assert.Equal(t, refs["pay-3"], left[0][1])
}

// Pages loaded at once on a RabbitMQ dead-letter queue (two tabs, a
// replay's confirmation beside a listing) each see every record: a read
// takes the messages and puts them back, so two reads at once would each
// see part of the queue, and the console reads each queue one request at
// a time.
func TestConsoleConcurrentPagesOnRabbitMQSeeEveryRecord(t *testing.T) {
	u := testenv.AMQPURL(t)
	queue := testenv.Uniq("orders")
	testenv.DeleteQueues(t, u, queue, queue+".dlq")
	pool, _ := pgtest.Schema(t)
	svc := testenv.StartService(t, pool, testenv.OpenAMQPSource(t, u, queue), "billing")
	ch := testenv.AMQPChannel(t, u)
	for _, id := range []string{"pay-1", "pay-2", "pay-3"} {
		testenv.PublishAMQP(t, ch, queue, amqp091.Publishing{MessageId: id, Body: testenv.JSON(1, "fail")})
	}
	svc.WaitSettled(t, 3)
	dl, err := dlq.NewAMQP(dlq.AMQPConfig{URL: u, Queue: queue + ".dlq"})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{dl}, Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	const pages = 4
	counts := make(chan int, pages)
	for range pages {
		go func() {
			resp, err := http.Get(srv.URL + "/dlq?q=0")
			if err != nil {
				counts <- -1
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			counts <- len(dataRef.FindAllString(string(b), -1))
		}()
	}
	for range pages {
		assert.Equal(t, 3, <-counts, "a page listed part of the queue")
	}
}

// A replay confirmed in a second tab after the first tab replayed the same
// records says that they were no longer in the queue, rather than
// "Replayed 0 of 0" alone, which reads as a selection of nothing; the
// records of the selection still there are replayed.
func TestReplayFromASecondTabSaysTheRecordsWereGone(t *testing.T) {
	u := testenv.AMQPURL(t)
	queue := testenv.Uniq("orders")
	testenv.DeleteQueues(t, u, queue, queue+".dlq")
	pool, _ := pgtest.Schema(t)
	svc := testenv.StartService(t, pool, testenv.OpenAMQPSource(t, u, queue), "billing")
	ch := testenv.AMQPChannel(t, u)
	for _, id := range []string{"pay-1", "pay-2"} {
		testenv.PublishAMQP(t, ch, queue, amqp091.Publishing{MessageId: id, Body: testenv.JSON(1, "fail")})
	}
	svc.WaitSettled(t, 2)
	svc.Broken.Store(false)
	dl, err := dlq.NewAMQP(dlq.AMQPConfig{URL: u, Queue: queue + ".dlq"})
	require.NoError(t, err)
	h, err := console.New(console.Config{DB: svc.Pool, Queues: []dlq.Queue{dl}, AllowReplay: true, Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	refs := map[string]string{} // event id -> ref
	for _, m := range dataRef.FindAllStringSubmatch(get(t, srv.URL+"/dlq?q=0"), -1) {
		refs[m[2]] = m[1]
	}
	require.Len(t, refs, 2)
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
	confirm := post(url.Values{"q": {"0"}, "ref": {refs["pay-2"], refs["pay-2"]}})
	assert.NotContains(t, confirm, "no longer in the queue", "a ref posted twice is one record")
	first := post(url.Values{"q": {"0"}, "ref": {refs["pay-1"]}, "confirm": {"yes"}})
	assert.Contains(t, first, "Replayed 1 of 1")
	assert.NotContains(t, first, "no longer in the queue")
	second := post(url.Values{"q": {"0"}, "ref": {refs["pay-1"], refs["pay-2"]}, "confirm": {"yes"}})
	assert.Contains(t, second, "Replayed 1 of 1")
	assert.Contains(t, second, "1 selected record was no longer in the queue")
	third := post(url.Values{"q": {"0"}, "ref": {refs["pay-1"], refs["pay-2"], refs["pay-2"]}, "confirm": {"yes"}})
	assert.Contains(t, third, "Replayed 0 of 0")
	assert.Contains(t, third, "2 selected records were no longer in the queue", "a ref posted twice is one record")
	svc.WaitSettled(t, 4)
	assert.Equal(t, map[string]int{"pay-1": 1, "pay-2": 1}, svc.Effects(t))
}
