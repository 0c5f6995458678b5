package amqp_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/netcut"
	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/internal/rabbittemp"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	pgtest.Main(m)
}

// brokerURL returns AMQP_URL. Without it the test is skipped, or fails when
// ONCE_REQUIRE_SERVERS=1 (make test).
func brokerURL(t testing.TB) string {
	t.Helper()
	u := os.Getenv("AMQP_URL")
	if u == "" {
		if os.Getenv("ONCE_REQUIRE_SERVERS") == "1" {
			t.Fatal("AMQP_URL is not set and ONCE_REQUIRE_SERVERS=1: start a broker with scripts/rabbitmq.sh start DIR")
		}
		t.Skip("AMQP_URL is not set: start a broker with `eval \"$(scripts/rabbitmq.sh start DIR)\"` to run this test")
	}
	return u
}

// quietLogger drops the source's reconnect logs below warnings unless -v.
func testLogger(t testing.TB) *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

var unsafeChars = regexp.MustCompile(`[^a-zA-Z0-9_.-]+`)

// queueName returns a fresh queue name for t.
func queueName(t testing.TB) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	n := unsafeChars.ReplaceAllString(t.Name(), "_")
	if len(n) > 60 {
		n = n[:60]
	}
	return "once-test." + n + "." + hex.EncodeToString(b[:])
}

// admin is a test's own connection to the broker, for publishing,
// inspecting and cleaning up.
type admin struct {
	t    testing.TB
	url  string
	conn *amqp091.Connection
	ch   *amqp091.Channel // confirm mode
	mu   sync.Mutex
}

func newAdmin(t testing.TB) *admin { return newAdminAt(t, brokerURL(t)) }

// newAdminAt returns an admin connected to url.
func newAdminAt(t testing.TB, url string) *admin {
	t.Helper()
	conn, err := amqp091.Dial(url)
	require.NoError(t, err)
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	a := &admin{t: t, url: url, conn: conn, ch: ch}
	t.Cleanup(func() { _ = conn.Close() })
	return a
}

// channel returns a usable channel, reconnecting when a broker restart or
// a channel error closed the previous one.
func (a *admin) channel() (*amqp091.Channel, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.conn.IsClosed() {
		conn, err := amqp091.Dial(a.url)
		if err != nil {
			return nil, err
		}
		a.conn = conn
		a.t.Cleanup(func() { _ = conn.Close() })
	}
	if a.ch.IsClosed() {
		ch, err := a.conn.Channel()
		if err != nil {
			return nil, err
		}
		if err := ch.Confirm(false); err != nil {
			return nil, err
		}
		a.ch = ch
	}
	return a.ch, nil
}

// declare declares a durable queue of type typ and removes it (and its
// dead-letter queue) when the test ends.
func (a *admin) declare(queue string, typ amqp.QueueType) {
	a.t.Helper()
	ch, err := a.channel()
	require.NoError(a.t, err)
	args := amqp091.Table{}
	if typ == amqp.QueueQuorum {
		args["x-queue-type"] = "quorum"
	}
	_, err = ch.QueueDeclare(queue, true, false, false, false, args)
	require.NoError(a.t, err)
	a.cleanupQueue(queue)
}

// cleanupQueue deletes queue and queue.dlq when the test ends.
func (a *admin) cleanupQueue(queue string) {
	a.t.Cleanup(func() {
		if ch, err := a.channel(); err == nil {
			_, _ = ch.QueueDelete(queue, false, false, false)
		}
		if ch, err := a.channel(); err == nil {
			_, _ = ch.QueueDelete(queue+amqp.DeadLetterQueueSuffix, false, false, false)
		}
	})
}

// publish publishes msgs (persistent unless they say otherwise) and waits
// for every confirm.
func (a *admin) publish(exchange, key string, msgs ...amqp091.Publishing) error {
	ch, err := a.channel()
	if err != nil {
		return err
	}
	const batch = 500
	for len(msgs) > 0 {
		n := min(batch, len(msgs))
		dcs := make([]*amqp091.DeferredConfirmation, 0, n)
		for _, m := range msgs[:n] {
			if m.DeliveryMode == 0 {
				m.DeliveryMode = amqp091.Persistent
			}
			dc, err := ch.PublishWithDeferredConfirm(exchange, key, false, false, m)
			if err != nil {
				return err
			}
			dcs = append(dcs, dc)
		}
		for _, dc := range dcs {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			ok, err := dc.WaitContext(ctx)
			cancel()
			if err != nil {
				return err
			}
			if !ok {
				return errors.New("publish nacked")
			}
		}
		msgs = msgs[n:]
	}
	return nil
}

// ready returns the number of messages ready in queue.
func (a *admin) ready(queue string) (int, error) {
	ch, err := a.channel()
	if err != nil {
		return 0, err
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return 0, err
	}
	return q.Messages, nil
}

// getAll takes every message of queue with basic.get (acking them).
func (a *admin) getAll(queue string) ([]amqp091.Delivery, error) {
	ch, err := a.channel()
	if err != nil {
		return nil, err
	}
	var out []amqp091.Delivery
	for {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			return nil, err
		}
		if !ok {
			return out, nil
		}
		out = append(out, d)
	}
}

// jsonMsg is a message with an id, as our publishers write them.
func jsonMsg(id string, body string) amqp091.Publishing {
	return amqp091.Publishing{MessageId: id, ContentType: "application/json", Body: []byte(body)}
}

// openSource opens a source on queue with test-friendly backoff.
func openSource(t testing.TB, cfg amqp.Config) *amqp.Source {
	t.Helper()
	if cfg.URL == "" {
		cfg.URL = brokerURL(t)
	}
	if cfg.ReconnectMaxBackoff == 0 {
		cfg.ReconnectMinBackoff = 20 * time.Millisecond
		cfg.ReconnectMaxBackoff = 500 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	src, err := amqp.Open(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = src.Close() })
	return src
}

// receive calls src.Receive with a deadline.
func receive(t testing.TB, src consumer.Source) consumer.Delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	d, err := src.Receive(ctx)
	require.NoError(t, err)
	return d
}

// startProxy puts a TCP proxy in front of the broker, whose connections
// the test can cut or pause as a network failure would, and returns it and
// the broker URL through it.
func startProxy(t testing.TB, brokerURL string) (*netcut.Proxy, string) {
	t.Helper()
	u, err := url.Parse(brokerURL)
	require.NoError(t, err)
	p, err := netcut.NewProxy(u.Host)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	u.Host = p.Addr()
	return p, u.String()
}

// cutTheConnection cuts the one connection of a source through p, the
// consuming one, once the short-lived connection of Open's dead-letter
// check has left the proxy, and fails unless it cut exactly one.
func cutTheConnection(t testing.TB, p *netcut.Proxy) {
	t.Helper()
	require.Eventually(t, func() bool { return p.Conns() == 1 }, 10*time.Second, 5*time.Millisecond,
		"the proxy forwards %d connections, want the consuming one", p.Conns())
	require.Equal(t, 1, p.Cut())
}

// node is a RabbitMQ node of a test's own, started by scripts/rabbitmq.sh.
type node struct {
	url, name, dir string
	rabbit         rabbittemp.Node
}

// privateNode starts a node for t alone with scripts/rabbitmq.sh, so that
// stopping it disturbs no other test (packages share the node of make
// test), whether that shared broker is the harness's node or an external
// one (AMQP_URL). It skips the test where RabbitMQ is not installed, and
// fails it then under ONCE_REQUIRE_SERVERS=1 (make test installs it).
func privateNode(t testing.TB) node {
	t.Helper()
	brokerURL(t)
	script, err := filepath.Abs(filepath.Join("..", "..", "scripts", "rabbitmq.sh"))
	require.NoError(t, err)
	r := rabbittemp.Start(t, script)
	return node{url: r.URL, name: r.Name, dir: r.Dir, rabbit: r}
}

// shortConsumerTimeoutNode starts a private node whose consumer_timeout
// is one second, checked every 200ms (channel_tick_interval), so that a
// delivery left unacked past it has its channel closed by the broker
// within a test's time.
func shortConsumerTimeoutNode(t testing.TB) node {
	t.Helper()
	n := privateNode(t)
	n.ctl(t, "eval", "application:set_env(rabbit, consumer_timeout, 1000).")
	n.ctl(t, "eval", "application:set_env(rabbit, channel_tick_interval, 200).")
	return n
}

// ctl runs rabbitmqctl against the node.
func (n node) ctl(t testing.TB, args ...string) string {
	t.Helper()
	return n.rabbit.Ctl(t, args...)
}

// counterValue returns the sum of the named int64 counter in rd.
func counterValue(t testing.TB, rd *sdkmetric.ManualReader, name string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, rd.Collect(context.Background(), &rm))
	var total int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			sum, ok := m.Data.(metricdata.Sum[int64])
			require.True(t, ok, "%s is a %T", name, m.Data)
			for _, dp := range sum.DataPoints {
				total += dp.Value
			}
		}
	}
	return total
}

// effects is the business table of the end-to-end tests: one row per
// committed handling of an event.
const effectsDDL = `CREATE TABLE effects (event_id text NOT NULL, attempt int NOT NULL)`

type payload struct {
	N    int    `json:"n"`
	Fail bool   `json:"fail,omitempty"`
	Note string `json:"note,omitempty"`
}

// recordEffect is the handler of the end-to-end tests: it writes one
// effects row in the consumer's transaction, and fails permanently for
// payloads that ask for it.
func recordEffect(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
	if ev.Payload.Fail {
		return errors.New("the handler always fails for this payload")
	}
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, attempt) VALUES ($1, $2)`, ev.ID, ev.Attempt)
	return err
}

// effectCounts returns the number of effect rows and of distinct event ids.
func effectCounts(ctx context.Context, pool *pgxpool.Pool) (rows, distinct int, err error) {
	err = pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id) FROM effects`).Scan(&rows, &distinct)
	return rows, distinct, err
}

// requireExactlyOnce checks that each of ids has exactly one effect and
// nothing else has any.
func requireExactlyOnce(t testing.TB, pool *pgxpool.Pool, ids []string) {
	t.Helper()
	ctx := context.Background()
	rows, err := pool.Query(ctx, `SELECT event_id, count(*) FROM effects GROUP BY event_id`)
	require.NoError(t, err)
	got := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		require.NoError(t, rows.Scan(&id, &n))
		got[id] = n
	}
	require.NoError(t, rows.Err())
	var missing, doubled []string
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
		switch got[id] {
		case 1:
		case 0:
			missing = append(missing, id)
		default:
			doubled = append(doubled, fmt.Sprintf("%s x%d", id, got[id]))
		}
	}
	var unexpected []string
	for id := range got {
		if !want[id] {
			unexpected = append(unexpected, id)
		}
	}
	require.Empty(t, missing, "events without effect (lost)")
	require.Empty(t, doubled, "events with more than one effect")
	require.Empty(t, unexpected, "effects of events never published")
}

// eventIDs returns n ids with the given prefix.
func eventIDs(prefix string, n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%05d", prefix, i)
	}
	return ids
}

// messagesFor returns one JSON message per id.
func messagesFor(ids []string) []amqp091.Publishing {
	out := make([]amqp091.Publishing, len(ids))
	for i, id := range ids {
		out[i] = jsonMsg(id, fmt.Sprintf(`{"n":%d}`, i))
	}
	return out
}
