// Package testenv gives the tests of cmd/once real parts: a Kafka cluster
// (kfake, spoken to over TCP through sarama), the RabbitMQ node at
// AMQP_URL, PostgreSQL through internal/pgtest, and a real once consumer
// whose handler can be broken and fixed, so that dead letters of every
// kind are made the way production makes them.
package testenv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
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

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

var seq atomic.Int64

// Uniq returns a name unique in the test binary.
func Uniq(prefix string) string {
	return prefix + "-" + strconv.FormatInt(time.Now().UnixNano()%1e6, 10) + "-" + strconv.FormatInt(seq.Add(1), 10)
}

// Logger discards logs unless ONCE_TEST_LOG is set.
func Logger() *slog.Logger {
	if os.Getenv("ONCE_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// Sarama is a client configuration with short retry backoffs.
func Sarama() *sarama.Config {
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	sc.Metadata.Retry.Backoff = 50 * time.Millisecond
	sc.Consumer.Retry.Backoff = 50 * time.Millisecond
	sc.Producer.Retry.Backoff = 50 * time.Millisecond
	return sc
}

// Kafka is an in-process one-broker cluster, closed when the test ends.
type Kafka struct {
	t     testing.TB
	Addrs []string
	// Cluster is the kfake cluster, for tests that control its answers.
	Cluster *kfake.Cluster
	// Sarama returns the client configuration the helpers connect with.
	Sarama func() *sarama.Config
}

// NewKafka starts a cluster.
func NewKafka(t testing.TB) *Kafka {
	return NewSecuredKafka(t, Sarama)
}

// NewSecuredKafka starts a cluster with opts (kfake.EnableSASL,
// kfake.TLS), whose helpers connect with the configuration sc returns.
func NewSecuredKafka(t testing.TB, sc func() *sarama.Config, opts ...kfake.Opt) *Kafka {
	t.Helper()
	kf, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(200 * time.Millisecond)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(kf.Close)
	return &Kafka{t: t, Addrs: kf.ListenAddrs(), Cluster: kf, Sarama: sc}
}

// CreateTopic creates topic with partitions partitions.
func (k *Kafka) CreateTopic(topic string, partitions int32) {
	k.t.Helper()
	admin, err := sarama.NewClusterAdmin(k.Addrs, k.Sarama())
	require.NoError(k.t, err)
	defer admin.Close()
	require.NoError(k.t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false))
}

// Produce writes msgs, partition chosen by ProducerMessage.Partition.
func (k *Kafka) Produce(msgs ...*sarama.ProducerMessage) {
	k.t.Helper()
	sc := k.Sarama()
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	// Idempotent: a produce retried under load (a slow ack) must not write
	// a record twice, since the tests count records without producer ids
	// by their offsets, as the consumer does.
	sc.Producer.Idempotent = true
	sc.Net.MaxOpenRequests = 1
	p, err := sarama.NewSyncProducer(k.Addrs, sc)
	require.NoError(k.t, err)
	defer p.Close()
	require.NoError(k.t, p.SendMessages(msgs))
}

// Source opens a consumer-group source on topic with test timeouts. Each of
// configure, when given, changes the source's config before it opens.
func (k *Kafka) Source(group, topic string, configure ...func(*kafka.Config)) *kafka.Source {
	k.t.Helper()
	cfg := kafka.Config{
		Brokers: k.Addrs, Group: group, Topics: []string{topic},
		SessionTimeout: 2 * time.Second, HeartbeatInterval: 100 * time.Millisecond,
		RebalanceTimeout: 8 * time.Second, RevokeTimeout: 4 * time.Second,
		CommitInterval: 100 * time.Millisecond, FetchMaxWait: 50 * time.Millisecond,
		Sarama: k.Sarama(), Logger: Logger(), DeadLetter: kafka.DeadLetterConfig{Create: true},
	}
	for _, f := range configure {
		f(&cfg)
	}
	src, err := kafka.Open(k.t.Context(), cfg)
	require.NoError(k.t, err)
	return src
}

// AMQPURL returns AMQP_URL; without it the test is skipped, or fails
// under ONCE_REQUIRE_SERVERS=1 (make test).
func AMQPURL(t testing.TB) string {
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

// AMQPChannel returns a confirm-mode channel on url, closed when the test
// ends.
func AMQPChannel(t testing.TB, url string) *amqp091.Channel {
	t.Helper()
	conn, err := amqp091.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	return ch
}

// PublishAMQP publishes p to the default exchange with routing key queue
// and waits for the broker's confirm.
func PublishAMQP(t testing.TB, ch *amqp091.Channel, queue string, p amqp091.Publishing) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, p)
	require.NoError(t, err)
	ok, err := c.WaitContext(ctx)
	require.NoError(t, err)
	require.True(t, ok)
}

// DeleteQueues removes queues when the test ends.
func DeleteQueues(t testing.TB, url string, queues ...string) {
	t.Cleanup(func() {
		conn, err := amqp091.Dial(url)
		if err != nil {
			return
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			return
		}
		for _, q := range queues {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
	})
}

// OpenAMQPSource opens a source on queue (dead letters to queue+".dlq"),
// with the hash fallback id, so events without an id get one.
func OpenAMQPSource(t testing.TB, url, queue string) *amqp.Source {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	src, err := amqp.Open(ctx, amqp.Config{URL: url, Queue: queue, FallbackID: true, Logger: Logger()})
	require.NoError(t, err)
	return src
}

// Payload is the events' JSON value.
type Payload struct {
	N int `json:"n"`
	// Mode says how the handler treats the event while the service is
	// broken: "ok" (handled), "fail" (a permanent error), "panic", and
	// "always" (fails even once fixed).
	Mode string `json:"mode"`
}

// LegacyPrefix starts values the broken decoder cannot read.
const LegacyPrefix = "legacy:"

// Service is a real once consumer whose handler writes one row per event
// into effects(event_id, n), with no unique key, so that a second effect
// of an event would show as a second row. While Broken, events of mode
// fail and panic fail, and values starting with LegacyPrefix do not
// decode: they are dead-lettered with kinds handler, panic and decode.
type Service struct {
	Name   string
	Pool   *pgxpool.Pool
	Broken atomic.Bool
	C      *consumer.Consumer[Payload]
	stop   func()
}

// Stop stops the consumer (its source is closed, offsets committed) and
// waits for it; it may be called more than once.
func (s *Service) Stop() { s.stop() }

// EffectsTable is the DDL of the table the service writes.
const EffectsTable = `CREATE TABLE IF NOT EXISTS effects (event_id text NOT NULL, n int NOT NULL, at timestamptz NOT NULL DEFAULT now())`

// StartService migrates, starts a consumer named name on src and stops it
// when the test ends. It starts broken. Each of configure, when given,
// changes the consumer's config before it starts.
func StartService(t testing.TB, pool *pgxpool.Pool, src consumer.Source, name string, configure ...func(*consumer.Config)) *Service {
	t.Helper()
	_, err := pool.Exec(context.Background(), EffectsTable)
	require.NoError(t, err)
	s := &Service{Name: name, Pool: pool}
	s.Broken.Store(true)
	decode := func(data []byte, v any) error {
		if rest, ok := strings.CutPrefix(string(data), LegacyPrefix); ok {
			if s.Broken.Load() {
				return errors.New("legacy format not supported")
			}
			data = []byte(rest)
		}
		return json.Unmarshal(data, v)
	}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[Payload]) error {
		switch {
		case ev.Payload.Mode == "always":
			return consumer.Permanent(errors.New("always fails"))
		case s.Broken.Load() && ev.Payload.Mode == "fail":
			return consumer.Permanent(fmt.Errorf("payment service rejected event %d", ev.Payload.N))
		case s.Broken.Load() && ev.Payload.Mode == "panic":
			panic("nil map in handler")
		}
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, n) VALUES ($1, $2)`, ev.ID, ev.Payload.N)
		return err
	}
	cfg := consumer.Config{
		Name:         name,
		Decoder:      decode,
		Retry:        consumer.RetryPolicy{MaxAttempts: 1},
		InfraBackoff: consumer.Backoff{Initial: 10 * time.Millisecond, Max: 500 * time.Millisecond},
		Telemetry:    consumer.TelemetryConfig{Logger: Logger()},
	}
	for _, f := range configure {
		f(&cfg)
	}
	c, err := consumer.New(pool, src, h, cfg)
	require.NoError(t, err)
	s.C = c
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	s.stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil && !errors.Is(err, context.Canceled) {
					t.Errorf("consumer %s: %v", name, err)
				}
			case <-time.After(30 * time.Second):
				t.Errorf("consumer %s did not stop within 30s", name)
			}
		})
	}
	t.Cleanup(s.stop)
	return s
}

// WaitSettled waits until the consumer has received at least n deliveries
// and settled every one it received.
func (s *Service) WaitSettled(t testing.TB, n uint64) {
	t.Helper()
	require.Eventually(t, func() bool {
		st := s.C.Stats()
		settled := st.Handled + st.Duplicates + st.Skipped + st.DeadLettered
		return st.Received >= n && settled == st.Received
	}, 60*time.Second, 10*time.Millisecond, "consumer %s never settled %d deliveries: %+v", s.Name, n, s.C.Stats())
}

// Effects returns the number of effect rows per event id. A Kafka fallback
// id (topic/partition/offset@topic-id) is counted under
// topic/partition/offset: the topic id is the same for every record of a
// test's topic, and the tests name records by their position.
func (s *Service) Effects(t testing.TB) map[string]int {
	t.Helper()
	rows, err := s.Pool.Query(context.Background(), `SELECT event_id, count(*) FROM effects GROUP BY event_id`)
	require.NoError(t, err)
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		require.NoError(t, rows.Scan(&id, &n))
		if at := strings.LastIndex(id, "@"); at > 0 && strings.Count(id[:at], "/") == 2 {
			id = id[:at]
		}
		out[id] += n
	}
	require.NoError(t, rows.Err())
	return out
}

// JSON returns the JSON of a payload.
func JSON(n int, mode string) []byte {
	b, _ := json.Marshal(Payload{N: n, Mode: mode})
	return b
}

// SchemaURL is the test database's URL with search_path set to schema, for
// commands that take a DATABASE_URL.
func SchemaURL(schema string) string {
	u := pgtest.URL()
	sep := "?"
	if strings.Contains(u, "?") {
		sep = "&"
	}
	return u + sep + "search_path=" + schema
}

// SilentBroker listens on a loopback port, accepts connections and never
// answers: a broker that hangs, or a firewall that lets the handshake
// through. Each accepted connection is announced on the channel (without
// blocking); all are closed when the test ends.
func SilentBroker(t testing.TB) (string, <-chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	accepted := make(chan struct{}, 1)
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
			select {
			case accepted <- struct{}{}:
			default:
			}
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
	return ln.Addr().String(), accepted
}

// FailsAgainstSilentBroker calls call with the address of a SilentBroker
// and a context that ends after a minute: longer than a Kafka client whose
// requests wait 8 s needs to give up, shorter than sarama's own defaults
// (30 s a request, four metadata tries). It fails t unless call returns
// within 35 s an error of its own, not the context's, that says a read
// timed out; it returns that error.
func FailsAgainstSilentBroker(t testing.TB, call func(ctx context.Context, addr string) error) error {
	t.Helper()
	addr, _ := SilentBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	started := time.Now()
	err := call(ctx, addr)
	took := time.Since(started)
	require.Error(t, err)
	require.NotErrorIs(t, err, context.DeadlineExceeded, "the call waited %v for the silent broker, until the test's deadline", took)
	require.Less(t, took, 35*time.Second, "the call waited for the silent broker")
	require.ErrorContains(t, err, "i/o timeout")
	return err
}
