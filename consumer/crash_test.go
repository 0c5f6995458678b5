package consumer_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// tableSource is a durable queue in a PostgreSQL table, so that a consumer
// process can be killed and another one pick up what it left unacked. It
// exists for the subprocess crash tests of the core only.
type tableSource struct {
	pool *pgxpool.Pool
	last int64
	ctx  context.Context
}

type tableDelivery struct {
	s *tableSource
	m *consumer.Message
}

func (d *tableDelivery) Message() *consumer.Message { return d.m }
func (d *tableDelivery) Context() context.Context   { return d.s.ctx }
func (d *tableDelivery) Ack(ctx context.Context) error {
	_, err := d.s.pool.Exec(ctx, `UPDATE queue SET acked = true WHERE pos = $1`, d.m.Offset)
	return err
}
func (d *tableDelivery) DeadLetter(ctx context.Context, dl *consumer.DeadLetter) error {
	return errors.New("tableSource has no dead-letter destination")
}

func (s *tableSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	for {
		var m consumer.Message
		var id string
		err := s.pool.QueryRow(ctx, `SELECT pos, id, value FROM queue WHERE pos > $1 AND NOT acked ORDER BY pos LIMIT 1`,
			s.last).Scan(&m.Offset, &id, &m.Value)
		if err == nil {
			s.last = m.Offset
			m.Topic, m.Partition, m.Stream, m.Headers = "queue", 0, "queue/0", map[string]string{"id": id}
			return &tableDelivery{s: s, m: &m}, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return nil, err
		}
		select { // poll interval of this table-backed queue
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func (s *tableSource) Close() error { return nil }

// killAt makes the process exit at the k-th Ack, before acking: the
// transaction of that message has committed, its ack is lost.
type killAt struct {
	*tableSource
	k, n int
}

type killingDelivery struct {
	consumer.Delivery
	kill bool
}

func (d killingDelivery) Ack(ctx context.Context) error {
	if d.kill {
		os.Exit(3)
	}
	return d.Delivery.Ack(ctx)
}

func (s *killAt) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.tableSource.Receive(ctx)
	if err != nil {
		return nil, err
	}
	s.n++
	return killingDelivery{Delivery: d, kill: s.n == s.k}, nil
}

func crashHandler(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, n) VALUES ($1, $2)`, ev.ID, ev.Payload.N)
	return err
}

func TestCrashChild(t *testing.T) {
	if os.Getenv("ONCE_CRASH_CHILD") == "" {
		t.Skip("run by TestProcessKilledBetweenCommitAndAck as its consumer process")
	}
	k, _ := strconv.Atoi(os.Getenv("ONCE_CRASH_AT"))
	pool := pgtest.NewPool(t, os.Getenv("ONCE_CRASH_SCHEMA"))
	src := &killAt{tableSource: &tableSource{pool: pool, ctx: context.Background()}, k: k}
	c, err := consumer.New(pool, src, crashHandler, fastConfig("crash"))
	require.NoError(t, err)
	require.NoError(t, c.Run(context.Background())) // exits the process at the k-th ack
}

// newTableQueue creates the queue and business tables in the test's schema
// and fills the queue with total events.
func newTableQueue(t *testing.T, total int) (*pgxpool.Pool, string) {
	pool, schema := pgtest.Schema(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE queue (pos bigserial PRIMARY KEY, id text, value bytea, acked bool NOT NULL DEFAULT false);
		CREATE TABLE effects (event_id text NOT NULL, n int NOT NULL, seq bigserial)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO queue (id, value) SELECT 'e' || i, convert_to('{"n":' || i || '}', 'UTF8')
		FROM generate_series(0, $1 - 1) AS i`, total)
	require.NoError(t, err)
	return pool, schema
}

// runCrashChild runs TestCrashChild as a consumer process with env and
// requires it to die with exit status want.
func runCrashChild(t *testing.T, schema string, want int, env ...string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), "ONCE_CRASH_CHILD=1", "ONCE_CRASH_SCHEMA="+schema, "DATABASE_URL="+pgtest.URL())
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "%s", out)
	require.Equal(t, want, exit.ExitCode(), "%s", out)
	return string(out)
}

// recoverAndCount runs a consumer until the queue is drained and requires
// every event's effect exactly once. It returns the consumer's stats.
func recoverAndCount(t *testing.T, pool *pgxpool.Pool, total int) consumer.Stats {
	ctx := context.Background()
	c, err := consumer.New(pool, &tableSource{pool: pool, ctx: ctx}, crashHandler, fastConfig("crash"))
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool {
		// A failed count is no drained queue: n would stay 0.
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM queue WHERE NOT acked`).Scan(&n)
		return err == nil && n == 0
	}, 60*time.Second, 10*time.Millisecond)
	require.NoError(t, stop())
	requireEffectsOnce(t, pool, total)
	return c.Stats()
}

// A consumer process is killed right after the commit of a message and
// before its ack. The next process gets that message again, finds its claim
// and skips it: every effect exactly once.
func TestProcessKilledBetweenCommitAndAck(t *testing.T) {
	const total = 30
	pool, schema := newTableQueue(t, total)
	for _, k := range []int{5, 12} { // two crashes, at different messages
		runCrashChild(t, schema, 3, "ONCE_CRASH_AT="+strconv.Itoa(k))
	}
	var unacked int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM queue WHERE NOT acked`).Scan(&unacked))
	require.Greater(t, unacked, 0, "the crashes left messages unacked")

	st := recoverAndCount(t, pool, total)
	assert.GreaterOrEqual(t, st.Duplicates, uint64(1), "the message committed before the kill is skipped")
}
