package pgtest

import (
	"context"
	"net"
	neturl "net/url"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/internal/netcut"
)

// NewPoolThroughProxy is NewPoolWith on a pool whose connections reach the
// test database through a netcut.Proxy, returned with it, so that a test
// can break them as a network would (Pause, Cut, Strand). The proxy is
// closed when the test ends, before the pool: pgx drains a connection it
// closed until the server closes it too, for up to 15 s, which a stranded
// or paused connection never does.
func NewPoolThroughProxy(t testing.TB, schema string, configure func(*pgxpool.Config)) (*pgxpool.Pool, *netcut.Proxy) {
	t.Helper()
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	proxy, err := netcut.NewProxy(u.Host)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	pool := NewPoolWith(t, schema, func(c *pgxpool.Config) {
		dial := c.ConnConfig.DialFunc
		c.ConnConfig.DialFunc = func(ctx context.Context, network, _ string) (net.Conn, error) {
			return dial(ctx, network, proxy.Addr())
		}
		if configure != nil {
			configure(c)
		}
	})
	t.Cleanup(func() { _ = proxy.Close() })
	return pool, proxy
}
