// Package cut makes the broker clients' calls stop when a context ends.
// sarama's and amqp091's calls do not watch a context: one waiting on a
// broker that accepts connections and never answers waits out the
// client's own timeouts (minutes, counting retries). A Cutter dials the
// connections of one operation and closes them all at once, which makes
// every such call fail at once.
package cut

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"sync"
	"time"

	"github.com/IBM/sarama"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// ErrCut is the error of a dial after the Cutter cut its connections.
var ErrCut = errors.New("the operation ended: its connections are closed")

// Cutter dials connections and can close all of them at once, and refuse
// further dials.
type Cutter struct {
	dial func(ctx context.Context, network, addr string) (net.Conn, error)

	ctx    context.Context // ends at the cut
	cancel context.CancelFunc
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	cut    bool
}

// New returns a Cutter that makes its connections with dial, whose ctx
// ends when the Cutter cuts.
func New(dial func(ctx context.Context, network, addr string) (net.Conn, error)) *Cutter {
	ctx, cancel := context.WithCancel(context.Background())
	return &Cutter{dial: dial, ctx: ctx, cancel: cancel, conns: map[net.Conn]struct{}{}}
}

// DialContext dials addr, unless the Cutter has cut; the dial itself ends
// when the Cutter cuts or ctx ends.
func (c *Cutter) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	unwatch := context.AfterFunc(c.ctx, stop)
	defer unwatch()
	conn, err := c.dial(ctx, network, addr)
	if err != nil {
		if c.ctx.Err() != nil {
			return nil, ErrCut
		}
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cut {
		_ = conn.Close()
		return nil, ErrCut
	}
	c.conns[conn] = struct{}{}
	return &conn2{Conn: conn, c: c}, nil
}

// Dial is DialContext without a context of its own.
func (c *Cutter) Dial(network, addr string) (net.Conn, error) {
	return c.DialContext(context.Background(), network, addr)
}

// Cut closes every connection the Cutter dialled and makes it dial no
// more. It may be called more than once.
func (c *Cutter) Cut() {
	c.cancel()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cut = true
	for conn := range c.conns {
		_ = conn.Close()
	}
	clear(c.conns)
}

// On cuts c when ctx ends, until the returned stop is called; stop
// reports false when the cut happened.
func (c *Cutter) On(ctx context.Context) (stop func() bool) {
	return context.AfterFunc(ctx, c.Cut)
}

// conn2 is a connection a Cutter tracks until it is closed.
type conn2 struct {
	net.Conn
	c *Cutter
}

func (cc *conn2) Close() error {
	cc.c.mu.Lock()
	delete(cc.c.conns, cc.Conn)
	cc.c.mu.Unlock()
	return cc.Conn.Close()
}

// Sarama makes a Cutter dial the connections of sc, as sarama would
// dial them: through sc's proxy dialer when it has one.
func Sarama(sc *sarama.Config) *Cutter {
	var dial func(ctx context.Context, network, addr string) (net.Conn, error)
	if base := sc.Net.Proxy.Dialer; sc.Net.Proxy.Enable && base != nil {
		dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
			if cd, ok := base.(interface {
				DialContext(ctx context.Context, network, addr string) (net.Conn, error)
			}); ok {
				return cd.DialContext(ctx, network, addr)
			}
			return base.Dial(network, addr)
		}
	} else {
		d := &net.Dialer{Timeout: sc.Net.DialTimeout, KeepAlive: sc.Net.KeepAlive, LocalAddr: sc.Net.LocalAddr}
		dial = d.DialContext
	}
	c := New(dial)
	sc.Net.Proxy.Enable = true
	sc.Net.Proxy.Dialer = c
	return c
}

// AMQP connects to url as amqp091.Dial and DialTLS do (the URL's
// connection_timeout, 30 s by default, bounds the connect and the
// handshake), through a Cutter that it returns. When ctx ends before the
// connection is made, it is cut and AMQP returns ctx's error.
func AMQP(ctx context.Context, url string, tlsConfig *tls.Config) (*amqp091.Connection, *Cutter, error) {
	timeout := 30 * time.Second
	if uri, err := amqp091.ParseURI(url); err == nil && uri.ConnectionTimeout > 0 {
		timeout = time.Duration(uri.ConnectionTimeout) * time.Millisecond
	}
	c := New(func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := (&net.Dialer{Timeout: timeout}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		// Cleared once the handshake is done, as amqp091 does.
		if err := conn.SetDeadline(time.Now().Add(timeout)); err != nil {
			_ = conn.Close()
			return nil, err
		}
		return conn, nil
	})
	var conn *amqp091.Connection
	err := Guard(ctx, c, func() error {
		var err error
		// A clone: amqp091 sets the ServerName of the config it is given.
		conn, err = amqp091.DialConfig(url, amqp091.Config{TLSClientConfig: tlsConfig.Clone(), Dial: c.Dial})
		return err
	})
	if err != nil {
		c.Cut()
		return nil, nil, err
	}
	return conn, c, nil
}

// Guard runs call, cutting the connections of c if ctx ends meanwhile. It
// returns ctx's error when it cut them, else call's.
func Guard(ctx context.Context, c *Cutter, call func() error) error {
	stop := c.On(ctx)
	err := call()
	if !stop() {
		return ctx.Err()
	}
	return err
}
