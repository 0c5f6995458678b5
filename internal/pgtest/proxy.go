package pgtest

import (
	"context"
	"encoding/binary"
	"io"
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

// NewPoolBehindPooler is NewPoolThroughProxy on connections that are told
// a process id other than their server process's, as a connection pooler
// (PgBouncer, a cloud provider's proxy) tells its clients an id of its own.
// The connections are plaintext: the rewrite reads the server's startup
// messages.
func NewPoolBehindPooler(t testing.TB, schema string, configure func(*pgxpool.Config)) (*pgxpool.Pool, *netcut.Proxy) {
	t.Helper()
	return NewPoolToldPID(t, schema, func(server uint32) uint32 { return server ^ 0x40000000 }, configure)
}

// NewPoolToldPID is NewPoolBehindPooler with the process id each
// connection is told: told(the server process's).
func NewPoolToldPID(t testing.TB, schema string, told func(server uint32) uint32, configure func(*pgxpool.Config)) (*pgxpool.Pool, *netcut.Proxy) {
	t.Helper()
	return NewPoolThroughProxy(t, schema, func(c *pgxpool.Config) {
		c.ConnConfig.TLSConfig = nil
		c.ConnConfig.Fallbacks = nil
		dial := c.ConnConfig.DialFunc
		c.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := dial(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &foreignPID{Conn: conn, told: told}, nil
		}
		if configure != nil {
			configure(c)
		}
	})
}

// foreignPID is a connection to PostgreSQL whose BackendKeyData message,
// read during the startup, carries another process id than the server
// sent. Past the first ReadyForQuery it reads through.
type foreignPID struct {
	net.Conn
	told    func(server uint32) uint32
	pending []byte
	started bool
}

func (c *foreignPID) Read(p []byte) (int, error) {
	for len(c.pending) == 0 && !c.started {
		if err := c.readStartupMessage(); err != nil {
			return 0, err
		}
	}
	if len(c.pending) > 0 {
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

// readStartupMessage reads one message of the server's startup into
// pending, the process id of a BackendKeyData changed.
func (c *foreignPID) readStartupMessage() error {
	var header [5]byte
	if _, err := io.ReadFull(c.Conn, header[:]); err != nil {
		return err
	}
	body := make([]byte, int(binary.BigEndian.Uint32(header[1:]))-4)
	if _, err := io.ReadFull(c.Conn, body); err != nil {
		return err
	}
	switch header[0] {
	case 'K': // BackendKeyData: process id, secret key
		binary.BigEndian.PutUint32(body[:4], c.told(binary.BigEndian.Uint32(body[:4])))
	case 'Z': // ReadyForQuery
		c.started = true
	}
	c.pending = append(header[:], body...)
	return nil
}
