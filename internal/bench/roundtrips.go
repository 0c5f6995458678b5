package bench

import (
	"bytes"
	"context"
	"net"
	"sync/atomic"
)

// wireCounter counts what a row's database connections send: every Write
// of a pgx connection is one flight of messages to the server, that is
// one round trip (pgx writes a pipelined batch at once and then reads
// its results), and the flights that carry a COMMIT are the row's
// transactions.
type wireCounter struct {
	writes, commits atomic.Int64
}

// commitQuery is how pgx sends a transaction's COMMIT.
var commitQuery = []byte("commit\x00")

// dial opens a TCP connection whose writes are counted.
func (w *wireCounter) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &countedConn{Conn: c, w: w}, nil
}

type countedConn struct {
	net.Conn
	w *wireCounter
}

// Write implements net.Conn.
func (c *countedConn) Write(p []byte) (int, error) {
	c.w.writes.Add(1)
	if bytes.Contains(p, commitQuery) {
		c.w.commits.Add(1)
	}
	return c.Conn.Write(p)
}

// snapshot returns the counts so far.
func (w *wireCounter) snapshot() (writes, commits int64) { return w.writes.Load(), w.commits.Load() }
