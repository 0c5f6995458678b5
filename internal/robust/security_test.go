package robust

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// The secrets of the security test: a payload field, the database
// password, the Kafka SASL password, the RabbitMQ password.
const (
	payloadSecret = "PAN-4111-1111-1111-SECRET"
	dbPassword    = "db-pass-Qw93"
	kafkaPassword = "kafka-pass-Lm27"
	amqpPassword  = "mq-pass-Vb55"
)

// logBuffer is a slog JSON handler's output, safe for concurrent writers.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *logBuffer) logger() *slog.Logger {
	return slog.New(slog.NewJSONHandler(l, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

// withPassword returns the test database URL with a password (the
// throwaway server trusts every local connection, so any password works).
func withPassword(t *testing.T, raw, password string) string {
	t.Helper()
	u, err := url.Parse(raw)
	require.NoError(t, err)
	u.User = url.UserPassword(u.User.Username(), password)
	return u.String()
}

type secretOrder struct {
	OrderID string `json:"order_id"`
	Card    string `json:"card"`
}

// A consumer on Kafka with SASL, its database reached with a password,
// handles, retries and dead-letters messages whose payloads hold a secret;
// at info level, no log line carries a payload or a password, and the
// logs do report the dead letters.
func TestLogsCarryNoPayloadOrCredential(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.EnableSASL(),
		kfake.Superuser("PLAIN", "svc", kafkaPassword), kfake.GroupMinSessionTimeout(200*time.Millisecond))
	require.NoError(t, err)
	defer kf.Close()
	sc := func() *sarama.Config {
		c := sarama.NewConfig()
		c.Version = sarama.V2_8_0_0
		c.Net.SASL.Enable = true
		c.Net.SASL.Mechanism = sarama.SASLTypePlaintext
		c.Net.SASL.User = "svc"
		c.Net.SASL.Password = kafkaPassword
		return c
	}
	admin, err := sarama.NewClusterAdmin(kf.ListenAddrs(), sc())
	require.NoError(t, err)
	for _, topic := range []string{"orders", "orders.dlq"} {
		require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false))
	}
	require.NoError(t, admin.Close())
	pc := sc()
	pc.Producer.Return.Successes = true
	pc.Producer.RequiredAcks = sarama.WaitForAll
	prod, err := sarama.NewSyncProducer(kf.ListenAddrs(), pc)
	require.NoError(t, err)
	defer prod.Close()
	msg := func(id, value string) *sarama.ProducerMessage {
		return &sarama.ProducerMessage{Topic: "orders", Value: sarama.StringEncoder(value),
			Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(id)}, {Key: []byte("x-card"), Value: []byte(payloadSecret)}}}
	}
	require.NoError(t, prod.SendMessages([]*sarama.ProducerMessage{
		msg("ok-1", `{"order_id":"o-1","card":"`+payloadSecret+`"}`),
		msg("malformed-1", `{"order_id":"o-2","card":"`+payloadSecret+`"`),
		msg("declined-1", `{"order_id":"declined","card":"`+payloadSecret+`"}`),
		msg("panics-1", `{"order_id":"panic","card":"`+payloadSecret+`"}`),
		msg("ok-2", `{"order_id":"o-3","card":"`+payloadSecret+`"}`),
	}))

	_, schema := pgtest.Schema(t)
	pcfg, err := pgxpool.ParseConfig(withPassword(t, pgtest.URL(), dbPassword))
	require.NoError(t, err)
	pcfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	require.NoError(t, err)
	defer pool.Close()
	_, err = pool.Exec(context.Background(), `CREATE TABLE paid (order_id text PRIMARY KEY)`)
	require.NoError(t, err)

	var logs logBuffer
	src, err := kafka.Open(t.Context(), kafka.Config{Brokers: kf.ListenAddrs(), Group: "billing", Topics: []string{"orders"},
		SessionTimeout: 2 * time.Second, HeartbeatInterval: 100 * time.Millisecond, CommitInterval: 100 * time.Millisecond,
		Sarama: sc(), Logger: logs.logger()})
	require.NoError(t, err)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[secretOrder]) error {
		switch ev.Payload.OrderID {
		case "declined":
			return errors.New("card declined") // the handler's own message: no payload in it
		case "panic":
			panic("card processor crashed")
		}
		_, err := tx.Exec(ctx, `INSERT INTO paid (order_id) VALUES ($1)`, ev.Payload.OrderID)
		return err
	}
	c, err := consumer.New(pool, src, h, consumer.Config{Name: "billing", Telemetry: consumer.TelemetryConfig{Logger: logs.logger()},
		Retry: consumer.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	require.Eventually(t, func() bool {
		s := c.Stats()
		return s.Handled == 2 && s.DeadLettered == 3
	}, 60*time.Second, 10*time.Millisecond, "two handled, three dead-lettered")
	cancel()
	require.NoError(t, <-done)

	// A second consumer whose database is down: its errors and logs name
	// the server, not the password.
	badPool, err := pgxpool.New(context.Background(),
		fmt.Sprintf("postgres://app:%s@127.0.0.1:%d/orders?sslmode=disable&connect_timeout=2", dbPassword, closedPort(t)))
	require.NoError(t, err)
	defer badPool.Close()
	src2, err := kafka.Open(t.Context(), kafka.Config{Brokers: kf.ListenAddrs(), Group: "billing-2", Topics: []string{"orders"}, Sarama: sc(), Logger: logs.logger()})
	require.NoError(t, err)
	c2, err := consumer.New(badPool, src2, h, consumer.Config{Name: "billing-2", Telemetry: consumer.TelemetryConfig{Logger: logs.logger()}})
	require.NoError(t, err)
	runErr := bounded(t, 30*time.Second, c2.Run)
	require.Error(t, runErr)
	assert.NotContains(t, runErr.Error(), dbPassword)

	// An AMQP source that cannot connect logs its retries with the URL
	// redacted.
	actx, acancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer acancel()
	_, amqpErr := amqp.Open(actx, amqp.Config{URL: fmt.Sprintf("amqp://svc:%s@127.0.0.1:%d/", amqpPassword, closedPort(t)),
		Queue: "orders", Logger: logs.logger()})
	require.Error(t, amqpErr)
	assert.NotContains(t, amqpErr.Error(), amqpPassword)

	out := logs.String()
	t.Logf("%d bytes of logs at info level", len(out))
	assert.Contains(t, out, "malformed-1", "the dead letters are logged (by event id)")
	assert.Contains(t, out, "declined-1")
	assert.Contains(t, out, "xxxxx", "the AMQP URL is logged redacted")
	for _, secret := range []string{payloadSecret, dbPassword, kafkaPassword, amqpPassword, `"card"`} {
		assert.NotContains(t, out, secret, "a log line carries %q", secret)
	}
}
