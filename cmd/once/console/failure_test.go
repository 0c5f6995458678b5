package console_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// serve answers one GET of path and returns the status and the body.
func serve(t *testing.T, h http.Handler, path string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	return rec.Code, rec.Body.String()
}

// A dead-letter destination the console could not read is not shown as
// an empty one: the consumers page says why it could not be read, and
// neither a count of 0 nor "Empty.".
func TestOverviewDoesNotShowAnUnreadableQueueAsEmpty(t *testing.T) {
	k := testenv.NewKafka(t)
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "never.created.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, Logger: testenv.Logger()})
	require.NoError(t, err)

	code, body := serve(t, h, "/")
	assert.Equal(t, http.StatusOK, code)
	assert.Contains(t, body, "never.created.dlq")
	assert.Contains(t, body, "could not be read")
	assert.False(t, strings.Contains(body, "Empty."), "an unreadable queue is shown as an empty one")
	assert.False(t, strings.Contains(body, "never.created.dlq</a>: 0"), "an unreadable queue is shown with a count of 0")
}

// With the database down, the consumers page still shows the dead
// letters it could read, and says the consumers could not be read, rather
// than being an error page.
func TestOverviewWithTheDatabaseDownShowsTheDeadLetters(t *testing.T) {
	_, dl := deadLetters(t)
	pool, err := pgxpool.New(context.Background(), "postgres://once@127.0.0.1:1/once?connect_timeout=1")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	h, err := console.New(console.Config{DB: pool, Queues: []dlq.Queue{dl}, Logger: testenv.Logger()})
	require.NoError(t, err)

	code, body := serve(t, h, "/")
	require.Equal(t, http.StatusOK, code, "the consumers page is an error page")
	assert.Contains(t, body, "The consumers could not be read")
	assert.Contains(t, body, "kafka topic orders.dlq</a>: 4", "the dead letters are shown")
	assert.Contains(t, body, "handler")
}

// silentBroker listens and accepts connections, and never answers: a
// broker that hangs, or a firewall that lets the handshake through.
func silentBroker(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String()
}

// Config.Timeout bounds a page's broker work also when the broker does
// not answer: the page says it could not read the queue within the bound,
// where the Kafka client alone would wait out its own timeouts (minutes).
func TestPagesAnswerWithinTimeoutWhenTheBrokerHangs(t *testing.T) {
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: []string{silentBroker(t)}, Topic: "orders.dlq"})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, AllowReplay: true, Timeout: time.Second, Logger: testenv.Logger()})
	require.NoError(t, err)
	for _, path := range []string{"/", "/dlq?q=0", "/record?q=0&ref=0:0", "POST /replay", "POST /replay?confirm=yes"} {
		answered := make(chan *httptest.ResponseRecorder, 1)
		go func() {
			var req *http.Request
			if p, ok := strings.CutPrefix(path, "POST "); ok {
				form := url.Values{"q": {"0"}, "ref": {"0:0"}}
				if strings.Contains(p, "confirm") {
					form.Set("confirm", "yes")
				}
				req = httptest.NewRequest(http.MethodPost, "/replay", strings.NewReader(form.Encode()))
				req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			} else {
				req = httptest.NewRequest(http.MethodGet, path, nil)
			}
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			answered <- rec
		}()
		select {
		case rec := <-answered:
			assert.Contains(t, rec.Body.String(), "no answer from kafka topic orders.dlq within 1s", path)
			if path != "/" {
				assert.Equal(t, http.StatusGatewayTimeout, rec.Code, path)
			}
		case <-time.After(15 * time.Second):
			t.Fatalf("%s: no answer 15s into a request bounded to 1s", path)
		}
	}
}

// A page cut off by the timeout while the broker did not answer frees its
// queue at once: the next page on it, once the broker answers again, is
// served, rather than waiting for the first page's read to end in the
// background after the client's own timeouts (30 s a request), and failing
// as if the broker still did not answer.
func TestPageAfterATimedOutOneIsServed(t *testing.T) {
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 1)
	k.Produce(&sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.StringEncoder("{}")})
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, Timeout: time.Second, Logger: testenv.Logger()})
	require.NoError(t, err)
	// The broker leaves one request for offsets unanswered, then answers.
	k.Cluster.ControlKey(int16(kmsg.ListOffsets), func(kmsg.Request) (kmsg.Response, error, bool) { return nil, nil, true })

	code, body := serve(t, h, "/dlq?q=0")
	require.Equal(t, http.StatusGatewayTimeout, code, body)
	assert.Contains(t, body, "no answer from kafka topic orders.dlq within 1s")
	code, body = serve(t, h, "/dlq?q=0")
	assert.Equal(t, http.StatusOK, code, body)
}

// One destination that does not answer costs the consumers page its own
// section only: the others are read within the same bound, not failed for
// the time the first one used up.
func TestOverviewReadsEveryQueueWithinTheTimeout(t *testing.T) {
	_, good := deadLetters(t)
	hung, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: []string{silentBroker(t)}, Topic: "hung.dlq"})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{hung, good}, Timeout: 2 * time.Second, Logger: testenv.Logger()})
	require.NoError(t, err)

	code, body := serve(t, h, "/")
	require.Equal(t, http.StatusOK, code)
	assert.Contains(t, body, "no answer from kafka topic hung.dlq within 2s")
	assert.False(t, strings.Contains(body, "no answer from kafka topic orders.dlq"), "the queue that answers is failed for the other's time")
	assert.Contains(t, body, "kafka topic orders.dlq</a>: 4")
}

// panickingQueue is a queue whose reads panic: a bug in a Queue a
// service wrote, or in a broker client.
type panickingQueue struct{ dlq.Queue }

func (panickingQueue) Browse(context.Context, func(*dlq.Record) error) error { panic("broken client") }

// A queue whose read panics fails its page, or its section of the
// consumers page, with an error: the panic does not end the process
// serving the console.
func TestAQueueThatPanicsFailsThePageNotTheProcess(t *testing.T) {
	_, dl := deadLetters(t)
	h, err := console.New(console.Config{Queues: []dlq.Queue{panickingQueue{dl}, dl}, Logger: testenv.Logger()})
	require.NoError(t, err)
	code, body := serve(t, h, "/")
	assert.Equal(t, http.StatusOK, code)
	assert.Contains(t, body, "broken client")
	assert.Contains(t, body, "kafka topic orders.dlq</a>: 4", "the other queue is shown")
	code, body = serve(t, h, "/dlq?q=0")
	assert.Equal(t, http.StatusBadGateway, code)
	assert.Contains(t, body, "broken client")
}

// spoofingQueue gives every record it reads an event id and a consumer
// name holding bidirectional controls.
type spoofingQueue struct{ dlq.Queue }

func (q spoofingQueue) Browse(ctx context.Context, fn func(*dlq.Record) error) error {
	return q.Queue.Browse(ctx, func(r *dlq.Record) error {
		r.Headers = append(r.Headers, dlq.Header{Key: consumer.HeaderEventID, Value: "order-\u202e7-redro"},
			dlq.Header{Key: consumer.HeaderConsumer, Value: "bill\u2066ing\u2069"})
		return fn(r)
	})
}

// Text from a dead letter that holds bidirectional controls, which would
// show it reordered (an event id that reads as another), is shown quoted
// on every page, as the CLI prints it.
func TestPagesQuoteBidiControls(t *testing.T) {
	_, dl := deadLetters(t)
	h, err := console.New(console.Config{Queues: []dlq.Queue{spoofingQueue{dl}}, Logger: testenv.Logger()})
	require.NoError(t, err)
	code, body := serve(t, h, "/dlq?q=0")
	require.Equal(t, http.StatusOK, code)
	// Shown, that is: between tags. (Attributes hold it as it is, for
	// the page's scripts; a browser does not render them.)
	assert.NotContains(t, body, ">order-\u202e")
	assert.NotContains(t, body, ">bill\u2066")
	assert.Contains(t, body, `>&#34;order-\u202e7-redro&#34;<`)
	code, body = serve(t, h, "/")
	require.Equal(t, http.StatusOK, code)
	assert.NotContains(t, body, ">bill\u2066")
	assert.Contains(t, body, `&#34;bill\u2066ing\u2069&#34;`)
}

// A nil queue in Config.Queues is refused by New: served, it would fail
// every page, each of which names every queue.
func TestNewRefusesANilQueue(t *testing.T) {
	_, dl := deadLetters(t)
	_, err := console.New(console.Config{Queues: []dlq.Queue{dl, nil}, Logger: testenv.Logger()})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "Queues[1]")
}

// A replay that fails (the broker down) leads back to the listing it was
// asked from, its filter kept, as a replay that succeeds does; so does a
// selection of nothing, and the page of a record that is gone.
func TestFailedReplayLeadsBackToItsListing(t *testing.T) {
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: []string{"127.0.0.1:1"}, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, AllowReplay: true, Logger: testenv.Logger()})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	const page = "dlq?q=0&kind=handler&after=0%3A7"
	for _, form := range []url.Values{
		{"q": {"0"}, "ref": {"0:8"}, "back": {page}, "confirm": {"yes"}},
		{"q": {"0"}, "ref": {"0:8"}, "back": {page}},
		{"q": {"0"}, "back": {page}},
	} {
		resp, err := http.PostForm(srv.URL+"/replay", form)
		require.NoError(t, err)
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		assert.GreaterOrEqual(t, resp.StatusCode, 400, "%v", form)
		assert.Equal(t, page, link(string(b), "back"), "%v: %s", form, b)
	}
	_, body := serve(t, h, "/record?q=0&ref=0:8&back="+url.QueryEscape(page))
	assert.Equal(t, page, link(body, "back"), "the record page that failed: %s", body)
}
