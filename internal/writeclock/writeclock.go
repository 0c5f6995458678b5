// Package writeclock wraps a dialer so that its connections record when
// they last wrote to their socket. The AMQP dead-letter publisher and the
// outbox's AMQP publisher use it to tell a copy or batch the broker takes
// slowly (a slow link: keep writing) from one it takes nothing of (a
// connection blocked under a resource alarm: give up after a bound).
package writeclock

import (
	"net"
	"sync/atomic"
	"time"
)

// Dial wraps dial: each connection it makes stores in wrote the time (Unix
// nanoseconds) of its latest write that moved bytes. Connections share
// wrote; it is safe for concurrent use.
func Dial(dial func(network, addr string) (net.Conn, error), wrote *atomic.Int64) func(network, addr string) (net.Conn, error) {
	return func(network, addr string) (net.Conn, error) {
		c, err := dial(network, addr)
		if err != nil {
			return nil, err
		}
		return &conn{Conn: c, wrote: wrote}, nil
	}
}

// conn is a net.Conn that records when it last wrote.
type conn struct {
	net.Conn
	wrote *atomic.Int64
}

// chunk is the most a conn writes at once: a write's progress shows only
// when it returns, and a frame of 128 KiB takes seconds on a slow link.
const chunk = 16 << 10

// Write writes b in pieces of at most chunk bytes, recording the time
// after each piece that moved bytes.
func (c *conn) Write(b []byte) (n int, err error) {
	for len(b) > 0 {
		m, err := c.Conn.Write(b[:min(len(b), chunk)])
		n += m
		if m > 0 {
			c.wrote.Store(time.Now().UnixNano())
		}
		if err != nil {
			return n, err
		}
		b = b[m:]
	}
	return n, nil
}
