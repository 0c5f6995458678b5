// Package netcut breaks TCP connections on purpose, as a network failure
// would, for the fault tests and the chaos driver: a Listener whose
// accepted connections can all be closed at once, and a Proxy in front of
// a server whose connections can be cut, stranded, or whose
// client-to-server traffic can be held.
package netcut

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Listener tracks the connections it accepts so that Cut can close them.
// Wrap a server's listener in it (e.g. kfake's, through kfake.WithListenFn).
type Listener struct {
	net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

// Accept accepts and tracks a connection.
func (l *Listener) Accept() (net.Conn, error) {
	conn, err := l.Listener.Accept()
	if err == nil {
		l.mu.Lock()
		l.conns = append(l.conns, conn)
		l.mu.Unlock()
	}
	return conn, err
}

// Cut closes every connection accepted so far and returns how many there
// were. The listener keeps accepting.
func (l *Listener) Cut() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := len(l.conns)
	for _, c := range l.conns {
		_ = c.Close()
	}
	l.conns = nil
	return n
}

// Proxy forwards TCP connections from a loopback port to one upstream
// address.
type Proxy struct {
	ln       net.Listener
	upstream string
	mu       sync.Mutex
	conns    map[net.Conn]struct{}
	pairs    map[net.Conn]*pair // by client connection
	// gate is write-locked while client-to-server traffic is held.
	gate sync.RWMutex
	// refusing: new connections are closed at once (Refuse).
	refusing atomic.Bool
	// rate caps client-to-server traffic, in bytes a second (Throttle);
	// 0: none.
	rate atomic.Int64
}

// NewProxy listens on a free loopback port and forwards each connection to
// upstream (host:port).
func NewProxy(upstream string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, upstream: upstream, conns: map[net.Conn]struct{}{}, pairs: map[net.Conn]*pair{}}
	go p.serve()
	return p, nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

func (p *Proxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		go p.pipe(c)
	}
}

// pair is a proxied connection: the client's, and the proxy's to the
// server.
type pair struct {
	client, server net.Conn
	// stranded: the server's side is closed and the client hears nothing
	// more (Strand).
	stranded atomic.Bool
}

func (p *Proxy) pipe(c net.Conn) {
	if p.refusing.Load() {
		_ = c.Close()
		return
	}
	u, err := net.DialTimeout("tcp", p.upstream, 5*time.Second)
	if err != nil {
		_ = c.Close()
		return
	}
	pr := &pair{client: c, server: u}
	if p.rate.Load() > 0 {
		narrow(c)
	}
	p.mu.Lock()
	p.conns[c], p.conns[u] = struct{}{}, struct{}{}
	p.pairs[c] = pr
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	go func() { p.toUpstream(pr); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, u); done <- struct{}{} }()
	<-done
	if pr.stranded.Load() {
		// The client's side stays open, unanswered, until the client
		// closes it (or Cut or Close does).
		<-done
	}
	_ = c.Close()
	_ = u.Close()
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, u)
	delete(p.pairs, c)
	p.mu.Unlock()
}

// toUpstream copies client bytes upstream, holding them while paused and
// dropping them once the connection is stranded.
func (p *Proxy) toUpstream(pr *pair) {
	buf := make([]byte, 32<<10)
	for {
		n, err := pr.client.Read(buf)
		if n > 0 && !pr.stranded.Load() {
			p.gate.RLock()
			_, werr := pr.server.Write(buf[:n])
			p.gate.RUnlock()
			if werr != nil && !pr.stranded.Load() {
				return
			}
			if rate := p.rate.Load(); rate > 0 {
				time.Sleep(time.Duration(int64(n) * int64(time.Second) / rate))
			}
		}
		if err != nil {
			return
		}
	}
}

// Strand closes the server's side of every proxied connection and leaves
// the client's open, silent: whatever the client sends is dropped and it
// hears nothing, not even the close, as when a server vanished without a
// word reaching its clients (a failover's old primary gone, a middlebox
// that forgot the connection). The server ends its sessions. New
// connections are forwarded as before. It returns how many connections it
// stranded.
func (p *Proxy) Strand() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, pr := range p.pairs {
		if pr.stranded.CompareAndSwap(false, true) {
			_ = pr.server.Close()
			n++
		}
	}
	return n
}

// Refuse closes each new connection at once while refuse is true, as a
// server that cannot be reached (or a host that resets every connection)
// would; the connections already proxied are left as they are.
func (p *Proxy) Refuse(refuse bool) { p.refusing.Store(refuse) }

// Pause holds every byte clients send upstream until Resume: the server
// sees its clients go silent while the connections stay up.
func (p *Proxy) Pause() { p.gate.Lock() }

// Resume forwards what Pause held and what follows.
func (p *Proxy) Resume() { p.gate.Unlock() }

// Throttle caps what each client sends upstream at bytesPerSecond, as a
// slow or congested link would (0 lifts the cap): a client writing more
// than its socket buffers hold waits in the write. The proxy's receive
// buffer of the connections it forwards is kept small meanwhile, so that
// the kernel does not take in megabytes the link would not.
func (p *Proxy) Throttle(bytesPerSecond int64) {
	p.rate.Store(bytesPerSecond)
	if bytesPerSecond <= 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.pairs {
		narrow(c)
	}
}

// narrow fixes the receive buffer of a throttled client connection at
// 64 KiB; the kernel would otherwise grow it to tens of megabytes.
func narrow(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetReadBuffer(64 << 10)
	}
}

// Conns returns how many client connections the proxy forwards now. A
// connection the client closed leaves the count once the proxy has seen
// both ends close, shortly after.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns) / 2
}

// Cut closes every proxied connection and returns how many client
// connections it cut. New connections are accepted as before.
func (p *Proxy) Cut() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
	n := len(p.conns) / 2
	clear(p.conns)
	return n
}

// Close stops accepting and cuts every connection.
func (p *Proxy) Close() error {
	err := p.ln.Close()
	p.Cut()
	return err
}
