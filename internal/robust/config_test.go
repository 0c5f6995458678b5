package robust

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// bounded runs f and fails the test if it panics or takes longer than d.
func bounded(t *testing.T, d time.Duration, f func(ctx context.Context) error) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				done <- fmt.Errorf("panic: %v", r)
			}
		}()
		done <- f(ctx)
	}()
	select {
	case err := <-done:
		require.NotContains(t, fmt.Sprint(err), "panic:", "a configuration error must not panic")
		return err
	case <-time.After(d + 5*time.Second):
		t.Fatalf("no answer within %s: a configuration error must not hang", d)
		return nil
	}
}

// closedPort returns a loopback port nothing listens on.
func closedPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	return port
}

func nopHandler(context.Context, pgx.Tx, consumer.Event[map[string]any]) error { return nil }

// Every invalid consumer.Config fails in New with ErrInvalidConfig and the
// field's name.
func TestConsumerConfigErrorsNameTheField(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	src := memsource.New(memsource.Options{}).Source()
	ok := consumer.Config{Name: "svc"}
	cases := []struct {
		name  string
		edit  func(c *consumer.Config)
		field string
	}{
		{"empty name", func(c *consumer.Config) { c.Name = "" }, "Name"},
		{"name over 200 bytes", func(c *consumer.Config) { c.Name = strings.Repeat("n", 201) }, "Name"},
		{"negative Identify.MaxIDLength", func(c *consumer.Config) { c.Identify.MaxIDLength = -1 }, "Identify.MaxIDLength"},
		{"negative Batch.Size", func(c *consumer.Config) { c.Batch.Size = -1 }, "Batch.Size"},
		{"negative Batch.Linger", func(c *consumer.Config) { c.Batch.Linger = -time.Millisecond }, "Batch.Linger"},
		{"negative Concurrency", func(c *consumer.Config) { c.Concurrency = -1 }, "Concurrency"},
		{"negative ReceiveBuffer", func(c *consumer.Config) { c.ReceiveBuffer = -1 }, "ReceiveBuffer"},
		{"negative Retry.MaxAttempts", func(c *consumer.Config) { c.Retry.MaxAttempts = -1 }, "Retry.MaxAttempts"},
		{"negative Retry.InitialBackoff", func(c *consumer.Config) { c.Retry.InitialBackoff = -time.Second }, "Retry.InitialBackoff"},
		{"negative Retry.MaxBackoff", func(c *consumer.Config) { c.Retry.MaxBackoff = -time.Second }, "Retry.MaxBackoff"},
		{"negative InfraBackoff.Initial", func(c *consumer.Config) { c.InfraBackoff.Initial = -time.Second }, "InfraBackoff.Initial"},
		{"negative InfraBackoff.Max", func(c *consumer.Config) { c.InfraBackoff.Max = -time.Second }, "InfraBackoff.Max"},
		{"negative CrashGuard.MaxCrashes", func(c *consumer.Config) { c.CrashGuard.MaxCrashes = -1 }, "CrashGuard.MaxCrashes"},
		{"negative HandlerTimeout", func(c *consumer.Config) { c.HandlerTimeout = -time.Second }, "HandlerTimeout"},
		{"negative ShutdownTimeout", func(c *consumer.Config) { c.ShutdownTimeout = -time.Second }, "ShutdownTimeout"},
		{"negative Retention.MaxAge", func(c *consumer.Config) { c.Retention.MaxAge = -time.Hour }, "Retention.MaxAge"},
		{"negative Retention.Interval", func(c *consumer.Config) { c.Retention.Interval = -time.Hour }, "Retention.Interval"},
		{"unknown Identify.OnConflict", func(c *consumer.Config) { c.Identify.OnConflict = 42 }, "Identify.OnConflict"},
		{"Retention.DutyCycle over 1", func(c *consumer.Config) { c.Retention.DutyCycle = 1.5 }, "Retention.DutyCycle"},
		{"negative Retention.DutyCycle", func(c *consumer.Config) { c.Retention.DutyCycle = -0.1 }, "Retention.DutyCycle"},
		{"Retry.InitialBackoff over Retry.MaxBackoff", func(c *consumer.Config) { c.Retry.InitialBackoff, c.Retry.MaxBackoff = time.Minute, time.Second }, "Retry.InitialBackoff"},
		{"InfraBackoff.Initial over InfraBackoff.Max", func(c *consumer.Config) { c.InfraBackoff.Initial, c.InfraBackoff.Max = time.Minute, time.Second }, "InfraBackoff.Initial"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ok
			tc.edit(&cfg)
			err := bounded(t, 5*time.Second, func(context.Context) error {
				_, err := consumer.New(pool, src, nopHandler, cfg)
				return err
			})
			require.ErrorIs(t, err, consumer.ErrInvalidConfig)
			assert.Contains(t, err.Error(), tc.field)
		})
	}
	t.Run("nil pool, source, handler", func(t *testing.T) {
		for _, f := range []func() error{
			func() error { _, err := consumer.New(nil, src, nopHandler, ok); return err },
			func() error { _, err := consumer.New(pool, nil, nopHandler, ok); return err },
			func() error { _, err := consumer.New[map[string]any](pool, src, nil, ok); return err },
			func() error {
				_, err := consumer.NewRouted(pool, src, consumer.NewRouter[any](consumer.RouterConfig{}), ok)
				return err
			},
		} {
			err := bounded(t, 5*time.Second, func(context.Context) error { return f() })
			require.ErrorIs(t, err, consumer.ErrInvalidConfig)
		}
	})
}

// Invalid table and schema names fail in dedup.New, naming the field; a
// store handed to the consumer carries its error into consumer.New.
func TestDedupConfigErrorsNameTheField(t *testing.T) {
	cases := []struct {
		name  string
		cfg   dedup.Config
		field string
	}{
		{"table with a semicolon", dedup.Config{Table: "events; DROP TABLE orders"}, "Table"},
		{"table with a dot", dedup.Config{Table: "public.events"}, "Table"},
		{"table with a quote", dedup.Config{Table: `ev"ents`}, "Table"},
		{"table starting with a digit", dedup.Config{Table: "1events"}, "Table"},
		{"table over 63 bytes", dedup.Config{Table: strings.Repeat("t", 64)}, "Table"},
		{"schema with a space", dedup.Config{Schema: "my schema"}, "Schema"},
		{"schema with a dash", dedup.Config{Schema: "my-schema"}, "Schema"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := bounded(t, 5*time.Second, func(context.Context) error {
				_, err := dedup.New(tc.cfg)
				return err
			})
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.field)
		})
	}
}

// A database that cannot be reached, or a DSN that does not parse, fails at
// start: Run returns the error (naming the server, never the password)
// instead of hanging or panicking.
func TestConsumerBadDatabaseFailsAtStart(t *testing.T) {
	port := closedPort(t)
	dsn := fmt.Sprintf("postgres://app:db-pass-Zq81@127.0.0.1:%d/orders?sslmode=disable&connect_timeout=2", port)
	_, err := pgxpool.ParseConfig("postgres://app:db-pass-Zq81@127.0.0.1:notaport/orders")
	require.Error(t, err, "a malformed DSN is refused by pgxpool before the consumer")
	assert.NotContains(t, err.Error(), "db-pass-Zq81", "pgx redacts the password of a bad DSN")

	pool, err := pgxpool.New(context.Background(), dsn) // lazy: connects on first use
	require.NoError(t, err)
	defer pool.Close()
	c, err := consumer.New(pool, memsource.New(memsource.Options{}).Source(), nopHandler, consumer.Config{Name: "svc"})
	require.NoError(t, err)
	err = bounded(t, 30*time.Second, c.Run)
	require.Error(t, err, "Run fails when it cannot create its tables")
	assert.Contains(t, err.Error(), fmt.Sprintf("127.0.0.1:%d", port), "the error names the server")
	assert.NotContains(t, err.Error(), "db-pass-Zq81", "the error does not carry the password")
}

// Every invalid kafka.Config fails in Open naming the field; an
// unreachable broker fails naming the address.
func TestKafkaConfigErrorsNameTheFieldOrServer(t *testing.T) {
	ok := kafka.Config{Brokers: []string{"127.0.0.1:9092"}, Group: "g", Topics: []string{"orders"}}
	cases := []struct {
		name  string
		edit  func(c *kafka.Config)
		field string
	}{
		{"no brokers", func(c *kafka.Config) { c.Brokers = nil }, "Brokers"},
		{"empty group", func(c *kafka.Config) { c.Group = "" }, "Group"},
		{"no topics", func(c *kafka.Config) { c.Topics = nil }, "Topics"},
		{"dead-letter topic consumed", func(c *kafka.Config) {
			c.Topics = []string{"orders", "orders.dlq"}
		}, "DeadLetter.Topic"},
		{"negative SessionTimeout", func(c *kafka.Config) { c.SessionTimeout = -time.Second }, "SessionTimeout"},
		{"negative HeartbeatInterval", func(c *kafka.Config) { c.HeartbeatInterval = -time.Second }, "HeartbeatInterval"},
		{"negative RebalanceTimeout", func(c *kafka.Config) { c.RebalanceTimeout = -time.Second }, "RebalanceTimeout"},
		{"negative CommitInterval", func(c *kafka.Config) { c.CommitInterval = -time.Second }, "CommitInterval"},
		{"negative RevokeTimeout", func(c *kafka.Config) { c.RevokeTimeout = -time.Second }, "RevokeTimeout"},
		{"negative FetchMaxWait", func(c *kafka.Config) { c.FetchMaxWait = -time.Second }, "FetchMaxWait"},
		{"negative FetchMax", func(c *kafka.Config) { c.FetchMax = -1 }, "FetchMax"},
		{"negative KeyLanes", func(c *kafka.Config) { c.KeyLanes = -1 }, "KeyLanes"},
		{"negative ReconnectMinBackoff", func(c *kafka.Config) { c.ReconnectMinBackoff = -time.Second }, "ReconnectMinBackoff"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ok
			tc.edit(&cfg)
			err := bounded(t, 5*time.Second, func(ctx context.Context) error {
				s, err := kafka.Open(ctx, cfg)
				if err == nil {
					_ = s.Close()
				}
				return err
			})
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.field)
		})
	}
	t.Run("unreachable broker", func(t *testing.T) {
		addr := fmt.Sprintf("127.0.0.1:%d", closedPort(t))
		cfg := ok
		cfg.Brokers = []string{addr}
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
		// Like amqp.Open: Open retries brokers that do not answer for as
		// long as its context allows, then fails with the last error.
		start := time.Now()
		err := bounded(t, 3*time.Second, func(ctx context.Context) error {
			s, err := kafka.Open(ctx, cfg)
			if err == nil {
				_ = s.Close()
			}
			return err
		})
		require.Error(t, err)
		assert.Less(t, time.Since(start), 6*time.Second, "Open returns when its context ends")
		assert.ErrorIs(t, err, context.DeadlineExceeded)
		assert.Contains(t, err.Error(), addr, "the error names the broker")
	})
}

// Every invalid amqp.Config fails in Open naming the field; an unreachable
// broker fails naming the server without its password.
func TestAMQPConfigErrorsNameTheFieldOrServer(t *testing.T) {
	ok := amqp.Config{URL: "amqp://app:mq-pass-Xy42@127.0.0.1:5672/", Queue: "orders"}
	cases := []struct {
		name  string
		edit  func(c *amqp.Config)
		field string
	}{
		{"no URL", func(c *amqp.Config) { c.URL = "" }, "URL"},
		{"not a URL", func(c *amqp.Config) { c.URL = "amqp://app:mq-pass-Xy42@[::1" }, "URL"},
		{"http URL", func(c *amqp.Config) { c.URL = "http://app:mq-pass-Xy42@127.0.0.1/" }, "URL"},
		{"no queue", func(c *amqp.Config) { c.Queue = "" }, "Queue"},
		{"negative prefetch", func(c *amqp.Config) { c.Prefetch = -1 }, "Prefetch"},
		{"negative DialTimeout", func(c *amqp.Config) { c.DialTimeout = -time.Second }, "DialTimeout"},
		{"negative Heartbeat", func(c *amqp.Config) { c.Heartbeat = -time.Second }, "Heartbeat"},
		{"negative ConfirmTimeout", func(c *amqp.Config) { c.ConfirmTimeout = -time.Second }, "ConfirmTimeout"},
		{"negative ReconnectMinBackoff", func(c *amqp.Config) { c.ReconnectMinBackoff = -time.Second }, "ReconnectMinBackoff"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ok
			tc.edit(&cfg)
			err := bounded(t, 5*time.Second, func(ctx context.Context) error {
				s, err := amqp.Open(ctx, cfg)
				if err == nil {
					_ = s.Close()
				}
				return err
			})
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.field)
			assert.NotContains(t, err.Error(), "mq-pass-Xy42", "the password leaked into the error")
		})
	}
	t.Run("unreachable broker", func(t *testing.T) {
		addr := fmt.Sprintf("127.0.0.1:%d", closedPort(t))
		cfg := ok
		cfg.URL = "amqp://app:mq-pass-Xy42@" + addr + "/"
		cfg.DialTimeout = 2 * time.Second
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
		// Open retries a broker that does not answer for as long as its
		// context allows (a broker restarting is not a configuration
		// error), then fails with the last dial error.
		start := time.Now()
		err := bounded(t, 3*time.Second, func(ctx context.Context) error {
			s, err := amqp.Open(ctx, cfg)
			if err == nil {
				_ = s.Close()
			}
			return err
		})
		require.Error(t, err)
		assert.Less(t, time.Since(start), 6*time.Second, "Open returns when its context ends")
		assert.ErrorIs(t, err, context.DeadlineExceeded)
		assert.Contains(t, err.Error(), addr, "the error names the server")
		assert.Contains(t, err.Error(), "connection refused", "the error says why")
		assert.NotContains(t, err.Error(), "mq-pass-Xy42", "the password leaked into the error")
	})
}
