package consumer_test

import (
	"context"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/netcut"
	"github.com/onceco/once/internal/pgtest"
)

// silentProxy returns the port of a proxy to upstream that holds every
// byte sent through it (netcut's Pause): a connection to it is accepted
// and never answered, as by a server that vanished behind an address
// still reachable (a hung host, a balancer in front of a dead primary).
func silentProxy(t *testing.T, upstream string) uint16 {
	t.Helper()
	proxy, err := netcut.NewProxy(upstream)
	require.NoError(t, err)
	proxy.Pause()
	t.Cleanup(func() {
		proxy.Resume()
		_ = proxy.Close()
	})
	_, port, err := net.SplitHostPort(proxy.Addr())
	require.NoError(t, err)
	p, err := strconv.ParseUint(port, 10, 16)
	require.NoError(t, err)
	return uint16(p)
}

// The crash guard's lock connection, opened outside the pool at a
// suspect's attempt, is bounded by DatabaseTimeout as the pool's dials
// are: a new connection that reaches a server that never answers gives
// the lock up, and the attempt goes on without it. Unbounded, the dial
// waited for ever while the suspect held the isolation every other
// message's transaction needs, and the whole consumer stood still,
// though docs/guarantees.md says a silent server holds a stream about
// DatabaseTimeout.
func TestCrashGuardLockConnectionToASilentServerIsBounded(t *testing.T) {
	_, schema := pgtest.Schema(t)
	var silentPort uint16
	var silent atomic.Bool
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		silentPort = silentProxy(t, net.JoinHostPort(c.ConnConfig.Host, strconv.Itoa(int(c.ConnConfig.Port))))
		c.MaxConns = 4
		c.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
			if silent.Load() {
				cc.Host, cc.Port = "127.0.0.1", silentPort
			}
			return nil
		}
	})
	ctx := context.Background()
	// Warm the pool, so that the consumer's own statements need no new
	// connection while new ones reach the silent server.
	var held []*pgxpool.Conn
	for range 4 {
		c, err := pool.Acquire(ctx)
		require.NoError(t, err)
		held = append(held, c)
	}
	for _, c := range held {
		c.Release()
	}

	b := memsource.New(memsource.Options{Streams: 1})
	b.Publish(consumer.Message{Value: []byte(`{"n":1}`), Headers: map[string]string{"id": "warm"}, Key: []byte("k")})
	handled := make(chan string, 4)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		handled <- ev.ID
		return nil
	}
	cfg := fastConfig("guard-lock-silent")
	cfg.Concurrency = 2
	cfg.DatabaseTimeout = 200 * time.Millisecond
	cfg.HandlerTimeout = time.Second
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	select {
	case id := <-handled:
		require.Equal(t, "warm", id)
	case <-time.After(10 * time.Second):
		t.Fatal("the first message was not handled")
	}

	silent.Store(true)
	// Redelivered: a suspect, whose attempt opens the lock connection.
	b.Publish(consumer.Message{Value: []byte(`{"n":2}`), Headers: map[string]string{"id": "suspect"}, Key: []byte("k"), Redelivered: true})
	select {
	case id := <-handled:
		require.Equal(t, "suspect", id)
	case <-time.After(20 * cfg.DatabaseTimeout):
		t.Fatalf("the suspect was not handled within %v: its lock connection's dial to a silent server is not bounded by DatabaseTimeout (%v)",
			20*cfg.DatabaseTimeout, cfg.DatabaseTimeout)
	}
}
