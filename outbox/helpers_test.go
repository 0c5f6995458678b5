package outbox_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/amqpout"
	"github.com/onceco/once/outbox/kafkaout"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	pgtest.Main(m)
}

// testLogger discards logs unless ONCE_TEST_LOG is set.
func testLogger() *slog.Logger {
	if os.Getenv("ONCE_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// wire is one message as it arrived at the broker.
type wire struct {
	ID, Type, Body string
	Key            string // Kafka only
	Headers        map[string]string
}

// broker is what the tests need of Kafka (kfake) or RabbitMQ: publishers for
// the relay, a destination, what reached it, and a consumer Source on it.
type broker interface {
	name() string
	// publisher returns a publisher closed when the test ends.
	publisher(t testing.TB) outbox.Publisher
	// destination returns a fresh destination: msg(key, body) addresses a
	// message to it.
	destination(t testing.TB) dest
}

// dest is one topic (Kafka) or queue (RabbitMQ).
type dest interface {
	// msg is a message to this destination.
	msg(key, body string) outbox.Message
	// unroutable is a message the broker refuses.
	unroutable(key, body string) outbox.Message
	// read returns what reached the destination, waiting until at least n
	// messages have (failing the test after a deadline).
	read(t testing.TB, n int) []wire
	// source is a consumer Source reading the destination.
	source(t testing.TB, name string) consumer.Source
}

// brokers returns the brokers the test runs against: kfake always, and
// RabbitMQ when AMQP_URL is set (required under ONCE_REQUIRE_SERVERS=1).
func brokers(t *testing.T) []broker {
	out := []broker{newKafka(t)}
	if r := rabbitFromEnv(t); r != nil {
		out = append(out, r)
	} else {
		t.Log("AMQP_URL is not set: RabbitMQ cases skipped")
	}
	return out
}

// rabbitFromEnv is the RabbitMQ at AMQP_URL; nil when it is not set, and a
// failure when ONCE_REQUIRE_SERVERS=1 (make test).
func rabbitFromEnv(t *testing.T) *rabbit {
	if u := os.Getenv("AMQP_URL"); u != "" {
		return &rabbit{url: u}
	}
	if os.Getenv("ONCE_REQUIRE_SERVERS") == "1" {
		t.Fatal("AMQP_URL is not set and ONCE_REQUIRE_SERVERS=1")
	}
	return nil
}

// rabbitOrSkip is rabbitFromEnv, skipping the test without a broker.
func rabbitOrSkip(t *testing.T) *rabbit {
	r := rabbitFromEnv(t)
	if r == nil {
		t.Skip("AMQP_URL is not set")
	}
	return r
}

// forEachBroker runs f as a subtest per broker.
func forEachBroker(t *testing.T, f func(t *testing.T, b broker)) {
	for _, b := range brokers(t) {
		t.Run(b.name(), func(t *testing.T) { f(t, b) })
	}
}

var seq atomic.Int64

func uniq(prefix string) string {
	var b [3]byte
	_, _ = rand.Read(b[:])
	return prefix + "-" + strconv.FormatInt(seq.Add(1), 10) + "-" + hex.EncodeToString(b[:])
}

// ---- Kafka (kfake, spoken to through sarama) ----

type kafkaBroker struct {
	t     testing.TB
	mu    sync.Mutex
	kf    *kfake.Cluster
	addrs []string
	port  int
	dir   string
}

// newKafka starts a one-broker kfake cluster on a fixed port with its data
// on disk, so that restart can stop and start it with its data.
func newKafka(t testing.TB) *kafkaBroker {
	t.Helper()
	k := &kafkaBroker{t: t, dir: t.TempDir(), port: freePort(t)}
	k.start()
	t.Cleanup(func() {
		k.mu.Lock()
		defer k.mu.Unlock()
		if k.kf != nil {
			k.kf.Close()
		}
	})
	return k
}

func (k *kafkaBroker) start() {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.Ports(k.port), kfake.DataDir(k.dir),
		kfake.GroupMinSessionTimeout(200*time.Millisecond))
	require.NoError(k.t, err)
	k.mu.Lock()
	k.kf, k.addrs = kf, kf.ListenAddrs()
	k.mu.Unlock()
}

// stop stops the broker; start brings it back with its data.
func (k *kafkaBroker) stop() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.kf.Close()
	k.kf = nil
}

func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func (k *kafkaBroker) name() string { return "kafka" }

func saramaConfig() *sarama.Config {
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	sc.Metadata.Retry.Backoff = 50 * time.Millisecond
	sc.Metadata.Retry.Max = 2
	sc.Producer.Retry.Backoff = 50 * time.Millisecond
	sc.Consumer.Retry.Backoff = 50 * time.Millisecond
	sc.Net.DialTimeout = 2 * time.Second
	sc.Net.ReadTimeout = 5 * time.Second
	sc.Net.WriteTimeout = 5 * time.Second
	return sc
}

func (k *kafkaBroker) publisher(t testing.TB) outbox.Publisher {
	sc := saramaConfig()
	sc.Producer.MaxMessageBytes = 64 << 10
	p, err := kafkaout.New(kafkaout.Config{Brokers: k.addrs, Sarama: sc})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func (k *kafkaBroker) destination(t testing.TB) dest {
	topic := uniq("orders")
	createTopic(t, k, topic)
	return &kafkaDest{k: k, topic: topic}
}

type kafkaDest struct {
	k     *kafkaBroker
	topic string
}

func (d *kafkaDest) msg(key, body string) outbox.Message {
	return outbox.Message{Topic: d.topic, Key: []byte(key), Body: []byte(body)}
}

func (d *kafkaDest) unroutable(key, body string) outbox.Message {
	return outbox.Message{Topic: d.topic + "-missing", Key: []byte(key), Body: []byte(body)}
}

func (d *kafkaDest) read(t testing.TB, n int) []wire {
	t.Helper()
	var out []wire
	require.Eventually(t, func() bool {
		recs, err := readTopic(d.k.addrs, d.topic)
		if err != nil {
			return false
		}
		out = out[:0]
		for _, r := range recs {
			w := wire{Key: string(r.Key), Body: string(r.Value), Headers: map[string]string{}}
			for _, h := range r.Headers {
				w.Headers[string(h.Key)] = string(h.Value)
			}
			w.ID, w.Type = w.Headers["id"], w.Headers["type"]
			out = append(out, w)
		}
		return len(out) >= n
	}, 60*time.Second, 20*time.Millisecond, "want at least %d records on %s", n, d.topic)
	return out
}

// readTopic reads every record of topic up to its high-water marks,
// partition by partition.
func readTopic(addrs []string, topic string) ([]*sarama.ConsumerMessage, error) {
	client, err := sarama.NewClient(addrs, saramaConfig())
	if err != nil {
		return nil, err
	}
	defer client.Close()
	parts, err := client.Partitions(topic)
	if err != nil {
		return nil, err
	}
	cons, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return nil, err
	}
	defer cons.Close()
	var out []*sarama.ConsumerMessage
	for _, p := range parts {
		hwm, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return nil, err
		}
		if hwm == 0 {
			continue
		}
		pc, err := cons.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			return nil, err
		}
		timeout := time.NewTimer(10 * time.Second)
		for done := false; !done; {
			select {
			case m := <-pc.Messages():
				out = append(out, m)
				done = m.Offset >= hwm-1
			case <-timeout.C:
				_ = pc.Close()
				return nil, context.DeadlineExceeded
			}
		}
		timeout.Stop()
		if err := pc.Close(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func (d *kafkaDest) source(t testing.TB, name string) consumer.Source {
	s, err := kafka.Open(t.Context(), kafka.Config{
		Brokers: d.k.addrs, Group: name, Topics: []string{d.topic},
		SessionTimeout: 2 * time.Second, HeartbeatInterval: 100 * time.Millisecond,
		RebalanceTimeout: 8 * time.Second, RevokeTimeout: 4 * time.Second,
		CommitInterval: 100 * time.Millisecond, FetchMaxWait: 50 * time.Millisecond,
		Sarama: saramaConfig(), Logger: testLogger(), DeadLetter: kafka.DeadLetterConfig{Create: true},
	})
	require.NoError(t, err)
	return s
}

// ---- RabbitMQ ----

type rabbit struct {
	url string
}

func (r *rabbit) name() string { return "rabbitmq" }

func (r *rabbit) publisher(t testing.TB) outbox.Publisher { return r.publisherAt(t, r.url) }

func (r *rabbit) publisherAt(t testing.TB, url string) outbox.Publisher {
	p, err := amqpout.New(amqpout.Config{URL: url, ConfirmTimeout: 2 * time.Second, DialTimeout: 2 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// destination declares a queue, removed when the test ends; messages go to
// it through the default exchange.
func (r *rabbit) destination(t testing.TB) dest {
	conn, err := amqp091.Dial(r.url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	q := uniq("once-outbox-test")
	_, err = ch.QueueDeclare(q, true, false, false, false, nil)
	require.NoError(t, err)
	t.Cleanup(func() {
		if c, err := amqp091.Dial(r.url); err == nil {
			if ch, err := c.Channel(); err == nil {
				_, _ = ch.QueueDelete(q, false, false, false)
				_, _ = ch.QueueDelete(q+amqp.DeadLetterQueueSuffix, false, false, false)
			}
			_ = c.Close()
		}
	})
	return &rabbitDest{r: r, conn: conn, ch: ch, queue: q}
}

type rabbitDest struct {
	r     *rabbit
	conn  *amqp091.Connection
	ch    *amqp091.Channel
	queue string
	mu    sync.Mutex
	seen  []wire
}

func (d *rabbitDest) msg(key, body string) outbox.Message {
	return outbox.Message{RoutingKey: d.queue, Key: []byte(key), Body: []byte(body)}
}

func (d *rabbitDest) unroutable(key, body string) outbox.Message {
	return outbox.Message{RoutingKey: d.queue + "-missing", Key: []byte(key), Body: []byte(body)}
}

// read takes the queue's messages (with basic.get, acked) into the
// destination's record and returns all seen so far; a test that also
// consumes the queue with a Source reads it before starting the source.
func (d *rabbitDest) read(t testing.TB, n int) []wire {
	t.Helper()
	d.mu.Lock()
	defer d.mu.Unlock()
	require.Eventually(t, func() bool {
		for {
			m, ok, err := d.ch.Get(d.queue, true)
			if err != nil || !ok {
				break
			}
			w := wire{ID: m.MessageId, Type: m.Type, Body: string(m.Body), Headers: map[string]string{}}
			for k, v := range m.Headers {
				w.Headers[k] = fmt.Sprint(v)
			}
			w.Key, _, _ = strings.Cut(w.Body, "/")
			d.seen = append(d.seen, w)
		}
		return len(d.seen) >= n
	}, 60*time.Second, 20*time.Millisecond, "want at least %d messages in %s", n, d.queue)
	return append([]wire(nil), d.seen...)
}

func (d *rabbitDest) source(t testing.TB, name string) consumer.Source {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s, err := amqp.Open(ctx, amqp.Config{URL: d.r.url, Queue: d.queue, Logger: testLogger()})
	require.NoError(t, err)
	return s
}

// ---- the outbox side ----

// startRelay runs a relay on pool until the test ends (or stop is called)
// and returns it with its stop function.
func startRelay(t testing.TB, pool *pgxpool.Pool, pub outbox.Publisher, cfg outbox.RelayConfig) (*outbox.Relay, func()) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testLogger()
	}
	r, err := outbox.NewRelay(pool, pub, cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Error("the relay did not stop within 30s of its context's cancellation")
			}
		})
	}
	t.Cleanup(stop)
	return r, stop
}

// migrated returns a test schema's pool with the outbox table created.
func migrated(t testing.TB) (*pgxpool.Pool, string) {
	t.Helper()
	pool, schema := pgtest.Schema(t)
	require.NoError(t, outbox.Migrate(context.Background(), pool))
	return pool, schema
}

// addCommitted writes msgs in one committed transaction.
func addCommitted(t testing.TB, pool *pgxpool.Pool, msgs ...outbox.Message) {
	t.Helper()
	require.NoError(t, pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		return outbox.Add(context.Background(), tx, msgs...)
	}))
}

// rows counts the outbox rows matching where.
func rows(t testing.TB, pool *pgxpool.Pool, where string) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE `+where).Scan(&n))
	return n
}

// waitRows waits until n rows match where.
func waitRows(t testing.TB, pool *pgxpool.Pool, where string, n int, within time.Duration) {
	t.Helper()
	require.Eventually(t, func() bool { return rows(t, pool, where) == n }, within, 10*time.Millisecond,
		"want %d outbox rows where %s", n, where)
}

// ids returns the distinct ids of ws, sorted, and how many copies each had.
func ids(ws []wire) ([]string, map[string]int) {
	count := map[string]int{}
	for _, w := range ws {
		count[w.ID]++
	}
	out := make([]string, 0, len(count))
	for id := range count {
		out = append(out, id)
	}
	sort.Strings(out)
	return out, count
}

// createTopic creates topic on k with 3 partitions.
func createTopic(t testing.TB, k *kafkaBroker, topic string) {
	t.Helper()
	admin, err := sarama.NewClusterAdmin(k.addrs, saramaConfig())
	require.NoError(t, err)
	defer admin.Close()
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 3, ReplicationFactor: 1}, false))
}

// countingLogger counts warnings and errors (and discards every record
// unless ONCE_TEST_LOG is set).
func countingLogger(n *atomic.Int64) *slog.Logger {
	return slog.New(countingHandler{next: testLogger().Handler(), n: n})
}

type countingHandler struct {
	next slog.Handler
	n    *atomic.Int64
}

func (h countingHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= slog.LevelWarn || h.next.Enabled(ctx, l)
}

func (h countingHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		h.n.Add(1)
	}
	if h.next.Enabled(ctx, r.Level) {
		return h.next.Handle(ctx, r)
	}
	return nil
}

func (h countingHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return countingHandler{next: h.next.WithAttrs(as), n: h.n}
}

func (h countingHandler) WithGroup(name string) slog.Handler {
	return countingHandler{next: h.next.WithGroup(name), n: h.n}
}

// metricValue is the sum of an Int64 counter's or gauge's data points.
func metricValue(t testing.TB, rd *sdkmetric.ManualReader, name string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, rd.Collect(context.Background(), &rm))
	var sum int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					sum += p.Value
				}
			case metricdata.Gauge[int64]:
				for _, p := range d.DataPoints {
					sum += p.Value
				}
			}
		}
	}
	return sum
}
