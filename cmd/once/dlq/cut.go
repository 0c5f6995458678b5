package dlq

import (
	"context"
	"errors"
	"net"
	"sync"
)

// errCut is the error of a dial after a cutter cut its connections.
var errCut = errors.New("dlq: the operation ended: its connections are closed")

// cutter dials the connections of one operation and can close all of them
// at once, and refuse further dials: the broker clients' calls do not
// watch a context, and one waiting on a broker that does not answer would
// wait out the client's own timeouts (minutes, counting retries) after the
// operation was cancelled. Cutting its connections makes every such call
// fail at once.
type cutter struct {
	// dial makes a connection; ctx ends when the cutter cuts.
	dial func(ctx context.Context, network, addr string) (net.Conn, error)

	ctx    context.Context
	cancel context.CancelFunc
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	cut    bool
}

func newCutter(dial func(ctx context.Context, network, addr string) (net.Conn, error)) *cutter {
	ctx, cancel := context.WithCancel(context.Background())
	return &cutter{dial: dial, ctx: ctx, cancel: cancel, conns: map[net.Conn]struct{}{}}
}

// DialContext dials addr, unless the cutter has cut; the dial itself ends
// when the cutter cuts or ctx ends.
func (c *cutter) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	unwatch := context.AfterFunc(c.ctx, stop)
	defer unwatch()
	conn, err := c.dial(ctx, network, addr)
	if err != nil {
		if c.ctx.Err() != nil {
			return nil, errCut
		}
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cut {
		_ = conn.Close()
		return nil, errCut
	}
	c.conns[conn] = struct{}{}
	return &cutConn{Conn: conn, c: c}, nil
}

// Dial is DialContext without a context of its own.
func (c *cutter) Dial(network, addr string) (net.Conn, error) {
	return c.DialContext(context.Background(), network, addr)
}

// Cut closes every connection the cutter dialled and makes it dial no
// more. It may be called more than once.
func (c *cutter) Cut() {
	c.cancel()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cut = true
	for conn := range c.conns {
		_ = conn.Close()
	}
	clear(c.conns)
}

// cutOn cuts c when ctx ends, until the returned stop is called.
func (c *cutter) cutOn(ctx context.Context) (stop func() bool) {
	return context.AfterFunc(ctx, c.Cut)
}

// cutConn is a connection a cutter tracks until it is closed.
type cutConn struct {
	net.Conn
	c *cutter
}

func (cc *cutConn) Close() error {
	cc.c.mu.Lock()
	delete(cc.c.conns, cc.Conn)
	cc.c.mu.Unlock()
	return cc.Conn.Close()
}

// orCtx returns ctx's error when ctx has ended (err then comes from a cut
// connection, or from a call the end of ctx stopped), else err.
func orCtx(ctx context.Context, err error) error {
	if err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}
