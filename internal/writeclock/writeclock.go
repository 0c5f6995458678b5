// Package writeclock wraps a dialer so that its connections record when
// they last wrote to their socket. The AMQP dead-letter publisher and the
// outbox's AMQP publisher use it to tell a copy or batch the broker takes
// slowly (a slow link: keep writing) from one it takes nothing of (a
// connection blocked under a resource alarm: give up after a bound).
package writeclock

import (
	"context"
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

// Wait waits for a write's answer on done, and returns it with true; it
// returns false when ctx ended first, or when the connections wrote
// nothing to their sockets (wrote, of Dial) for idle: a write the broker
// is taking runs as long as the link needs, one it takes nothing of is
// given up after idle.
func Wait[T any](ctx context.Context, done <-chan T, wrote *atomic.Int64, idle time.Duration) (T, bool) {
	start := time.Now()
	t := time.NewTimer(idle)
	defer t.Stop()
	for {
		select {
		case s := <-done:
			return s, true
		case <-ctx.Done():
			var zero T
			return zero, false
		case <-t.C:
			// A byte written since start: the wait runs from the last
			// write.
			last := time.Unix(0, wrote.Load())
			if last.Before(start) {
				last = start
			}
			wait := idle - time.Since(last)
			if wait <= 0 {
				var zero T
				return zero, false
			}
			t.Reset(wait)
		}
	}
}
