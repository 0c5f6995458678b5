package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/internal/pgtemp"
	"github.com/onceco/once/internal/pgtest"
)

func TestMain(m *testing.M) {
	// The demo's first run is this binary started again as a consumer
	// process (and killed); run the command instead of the tests.
	if os.Getenv(childEnv) != "" {
		os.Exit(realMain(signalContext(), os.Args[1:], os.Stdout, os.Stderr))
	}
	pgtest.Main(m)
}

// syncBuffer is a bytes.Buffer safe for a writer and a reader goroutine.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// waitMatch waits until re matches the buffer's text and returns the
// submatches.
func waitMatch(t *testing.T, buf *syncBuffer, re *regexp.Regexp) []string {
	t.Helper()
	var m []string
	require.Eventually(t, func() bool {
		m = re.FindStringSubmatch(buf.String())
		return m != nil
	}, 60*time.Second, 20*time.Millisecond, "output never matched %s:\n%s", re, buf)
	return m
}

// runCommand runs the command with args in this process, with
// DATABASE_URL set to the test database, and returns its exit code and
// output.
func runCommand(t *testing.T, ctx context.Context, args ...string) (int, string) {
	t.Helper()
	t.Setenv("DATABASE_URL", pgtest.URL())
	t.Setenv("BROKER", "") // the tests say -broker when they mean amqp
	var out, errOut syncBuffer
	code := realMain(ctx, args, &out, &errOut)
	text := out.String()
	if code != 0 {
		t.Logf("stdout:\n%s\nstderr:\n%s", text, errOut.String())
	}
	return code, text
}

// requireAMQP returns AMQP_URL, skipping the test without it unless
// ONCE_REQUIRE_SERVERS=1 (make test), where it fails.
func requireAMQP(t *testing.T) string {
	t.Helper()
	u := os.Getenv("AMQP_URL")
	if u == "" {
		if os.Getenv("ONCE_REQUIRE_SERVERS") == "1" {
			t.Fatal("AMQP_URL is not set and ONCE_REQUIRE_SERVERS=1: start a broker with scripts/rabbitmq.sh start DIR")
		}
		t.Skip("AMQP_URL is not set: start a broker with `eval \"$(scripts/rabbitmq.sh start DIR)\"` to run the RabbitMQ demo")
	}
	return u
}

func TestParseOptions(t *testing.T) {
	t.Setenv("KAFKA_BROKERS", "")
	t.Setenv("AMQP_URL", "")
	t.Setenv("BROKER", "")

	o, err := parseOptions(nil, os.Stderr)
	require.NoError(t, err)
	require.Equal(t, "demo", o.command)
	require.Equal(t, "kafka", o.broker)
	require.Equal(t, "order_demo", o.schema)
	require.NotZero(t, o.mix.Seed)

	o, err = parseOptions([]string{"serve", "-metrics-addr", "off"}, os.Stderr)
	require.NoError(t, err)
	require.Equal(t, "public", o.schema)
	require.Empty(t, o.metricsAddr)

	t.Setenv("KAFKA_BROKERS", "k1:9092,k2:9092")
	o, err = parseOptions([]string{"produce", "-orders", "10"}, os.Stderr)
	require.NoError(t, err)
	require.Equal(t, []string{"k1:9092", "k2:9092"}, o.kafkaBrokers)
	require.Equal(t, 10, o.mix.Orders)

	_, err = parseOptions([]string{"frobnicate"}, os.Stderr)
	require.ErrorContains(t, err, "unknown command")
	_, err = parseOptions([]string{"-broker", "nats"}, os.Stderr)
	require.ErrorContains(t, err, "want kafka or amqp")
	_, err = parseOptions([]string{"-broker", "amqp"}, os.Stderr)
	require.ErrorContains(t, err, "AMQP_URL")
	t.Setenv("KAFKA_BROKERS", "")
	_, err = parseOptions([]string{"produce"}, os.Stderr)
	require.ErrorContains(t, err, "KAFKA_BROKERS")
}

// The generator's plan adds up: every message is counted under one kind,
// and the expected ledger is the sum over paid orders.
func TestGeneratePlan(t *testing.T) {
	p := Generate(Mix{Orders: 1000, Duplicates: 0.1, IDless: 0.05, Malformed: 0.01, Violations: 0.03, Seed: 7})
	total := 0
	for _, n := range p.Sent {
		total += n
	}
	require.Equal(t, len(p.Messages), total)
	require.Len(t, p.Orders, 1000)
	require.Equal(t, p.Sent[kindIDless], p.Sent[kindIDlessDup])
	require.Equal(t, 10, p.Malformed)
	require.Equal(t, 30, p.Violations)
	require.Equal(t, 30, p.Sent[kindOrphanPayment]+p.Sent[kindCancelPaid]+p.Sent[kindSecondPayment])
	var sum int64
	paid := 0
	for _, o := range p.Orders {
		if o.Paid {
			sum += o.AmountCents
			paid++
		}
	}
	require.Equal(t, sum, p.LedgerSum)
	require.Equal(t, paid, p.LedgerRows)
	for _, m := range p.Messages {
		if m.Kind == kindIDless || m.Kind == kindIDlessDup {
			require.Empty(t, m.ID)
		} else {
			require.NotEmpty(t, m.ID, m.Kind)
		}
	}
	// The events of one order keep their order: created comes first.
	first := map[string]string{}
	for _, m := range p.Messages {
		if _, ok := first[m.Key]; !ok && m.Kind != kindMalformed && !strings.Contains(m.Key, "ghost") {
			first[m.Key] = m.Type
		}
	}
	for key, typ := range first {
		require.Equal(t, TypeCreated, typ, key)
	}
	require.Equal(t, Generate(Mix{Orders: 50, Duplicates: 0.1, Seed: 3}).Messages, Generate(Mix{Orders: 50, Duplicates: 0.1, Seed: 3}).Messages)
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}

// serve ends, with an error, when its consumer stops by itself: here its
// dedup tables are at a version newer than this code knows, so Run fails
// at once. The relay and the shipping consumer must not keep the process
// up (and /healthz green) with no consumer of orders.
func TestServeStopsWhenItsConsumerFails(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE once_schema_versions (component text NOT NULL, version integer NOT NULL,
		name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (component, version));
		INSERT INTO once_schema_versions (component, version, name) VALUES ('dedup:processed_events', 99, 'future')`)
	require.NoError(t, err)
	t.Setenv("DATABASE_URL", pgtest.URL())
	t.Setenv("KAFKA_BROKERS", "")
	t.Setenv("BROKER", "")
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var out, errOut syncBuffer
	done := make(chan int, 1)
	go func() {
		done <- realMain(runCtx, []string{"serve", "-schema", schema, "-name", "fail-" + schema, "-metrics-addr", "off"}, &out, &errOut)
	}()
	select {
	case code := <-done:
		require.Equal(t, 1, code, "stdout:\n%s\nstderr:\n%s", out.String(), errOut.String())
		require.Contains(t, errOut.String(), "schema is newer than this code")
	case <-time.After(60 * time.Second):
		cancel()
		<-done
		t.Fatalf("serve still ran 60s after its consumer failed\nstdout:\n%s\nstderr:\n%s", out.String(), errOut.String())
	}
}

// serve started while its database is down (restarting, failing over)
// waits for it and then consumes, rather than exit: a chaos member started
// just before a PostgreSQL restart ended with "failed to connect" and
// failed the run. A database that refuses the connection for good (here:
// no such database) is still an error at once.
func TestServeStartedWhileTheDatabaseIsDownWaitsForIt(t *testing.T) {
	ctx := context.Background()
	srv, err := pgtemp.Start(ctx, pgtemp.Options{})
	require.NoError(t, err)
	defer func() { _ = srv.Close() }()
	require.NoError(t, srv.Stop(ctx))
	t.Setenv("KAFKA_BROKERS", "")
	t.Setenv("BROKER", "")
	serve := func(ctx context.Context, url string, out, errOut *syncBuffer) <-chan int {
		t.Setenv("DATABASE_URL", url)
		done := make(chan int, 1)
		go func() {
			done <- realMain(ctx, []string{"serve", "-metrics-addr", "off", "-shipping=false", "-name", "db-wait"}, out, errOut)
		}()
		return done
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var out, errOut syncBuffer
	done := serve(runCtx, srv.URL(), &out, &errOut)
	waitMatch(t, &errOut, regexp.MustCompile(`waiting for the database \(attempt 2 failed`))
	require.NotContains(t, out.String(), "consuming", "serve went on without its database")
	require.NoError(t, srv.Restart(ctx))
	waitMatch(t, &out, regexp.MustCompile(`consuming orders as "db-wait"`))
	cancel()
	select {
	case code := <-done:
		require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out.String(), errOut.String())
	case <-time.After(60 * time.Second):
		t.Fatalf("serve did not stop 60s after its context ended\nstdout:\n%s\nstderr:\n%s", out.String(), errOut.String())
	}

	var out2, errOut2 syncBuffer
	done = serve(ctx, strings.Replace(srv.URL(), "/postgres?", "/no_such_database?", 1), &out2, &errOut2)
	select {
	case code := <-done:
		require.Equal(t, 1, code, "stdout:\n%s\nstderr:\n%s", out2.String(), errOut2.String())
		require.Contains(t, errOut2.String(), "no_such_database")
		require.NotContains(t, errOut2.String(), "waiting for the database")
	case <-time.After(60 * time.Second):
		t.Fatalf("serve kept waiting for a database that does not exist\nstdout:\n%s\nstderr:\n%s", out2.String(), errOut2.String())
	}
}

// -schema names the schema as given, as CREATE SCHEMA took it: an
// upper-case letter or a dash is not folded or split on the search_path.
func TestOpenPoolUsesTheSchemaAsNamed(t *testing.T) {
	ctx := context.Background()
	admin, err := pgxpool.New(ctx, pgtest.URL())
	require.NoError(t, err)
	defer admin.Close()
	schema := fmt.Sprintf("Order-Demo-%d", time.Now().UnixNano())
	t.Cleanup(func() { _, _ = admin.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`) })

	pool, err := openPool(ctx, pgtest.URL(), schema)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, Migrate(ctx, pool))
	var where string
	require.NoError(t, pool.QueryRow(ctx, `SELECT table_schema FROM information_schema.tables WHERE table_name = 'orders' AND table_schema = $1`,
		schema).Scan(&where), "the orders table is in schema %q", schema)
}

// A serve whose only error is the Kafka source's Close running past its
// CloseTimeout (nothing lost: the records of offsets not committed come
// again and are skipped) stops cleanly; any other error beside it does not.
func TestOnlyCloseTimeoutsIsACleanStop(t *testing.T) {
	timeout := fmt.Errorf("%w (10s): offsets marked since the last commit may not be committed", kafka.ErrCloseTimeout)
	closing := fmt.Errorf("once: closing source: %w", timeout)
	other := errors.New("once: database unreachable")
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"close timeout alone", closing, true},
		{"joined with nothing else", errors.Join(nil, closing), true},
		{"beside the shipping consumer's close timeout", errors.Join(closing, fmt.Errorf("shipping: %w", closing)), true},
		{"beside another error", errors.Join(other, closing), false},
		{"another error wrapping both", fmt.Errorf("run: %w", errors.Join(closing, other)), false},
		{"another error", other, false},
		{"no error", nil, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := onlyCloseTimeouts(c.err); got != c.want {
				t.Errorf("onlyCloseTimeouts(%v) = %v, want %v", c.err, got, c.want)
			}
		})
	}
}
