package outbox_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/kafkaout"
)

// slowConn reads at most rate bytes a second: a link between the relay and
// PostgreSQL slower than the batch it reads needs (rows of a few hundred
// KB on a busy or remote link; here scaled down).
type slowConn struct {
	net.Conn
	rate  int // bytes a second
	mu    sync.Mutex
	start time.Time
	read  int
}

func (c *slowConn) Read(p []byte) (int, error) {
	if len(p) > 16<<10 {
		p = p[:16<<10]
	}
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	if c.start.IsZero() {
		c.start = time.Now()
	}
	c.read += n
	due := c.start.Add(time.Duration(float64(c.read) / float64(c.rate) * float64(time.Second)))
	c.mu.Unlock()
	time.Sleep(time.Until(due))
	return n, err
}

// A read of the outbox is bounded by a fixed 10 s (statementTimeout), but
// what it reads is bounded by rows only (BatchSize): once a batch of rows
// takes longer than that to arrive (large bodies on a slow or busy link),
// every read is cut, the relay's session ends and it reads the same batch
// again, for ever. Nothing is published, nothing is parked, and the only
// sign is a Warn "database session ended; reconnecting" every few seconds.
func TestBatchOfLargeRowsSlowerToReadThanTheStatementBoundIsPublished(t *testing.T) {
	ctx := context.Background()
	k := newKafka(t)
	pool, schema := migrated(t)
	d := k.destination(t)
	const n, size = 500, 100 << 10 // 50 MB, at 4 MB/s: 12.5 s
	body := make([]byte, size)
	var msgs []outbox.Message
	for i := range n {
		_, _ = rand.Read(body)
		msgs = append(msgs, outbox.Message{Topic: d.(*kafkaDest).topic, Key: []byte(fmt.Sprint(i % 7)), Body: append([]byte(nil), body...)})
	}
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return outbox.Add(ctx, tx, msgs...) }))

	slow := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		dial := c.ConnConfig.DialFunc
		c.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := dial(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &slowConn{Conn: conn, rate: 4 << 20}, nil
		}
	})
	pub, err := kafkaout.New(kafkaout.Config{Brokers: k.addrs, Sarama: saramaConfig()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	startRelay(t, slow, pub, outbox.RelayConfig{PollInterval: 50 * time.Millisecond, SkipMigrate: true})
	defer func() { t.Logf("rows left: %d of %d", rowsLeft(t, pool), n) }()
	waitRows(t, pool, "true", 0, 90*time.Second)
}

func rowsLeft(t *testing.T, pool *pgxpool.Pool) int { return rows(t, pool, "true") }
