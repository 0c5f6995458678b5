package netcut

import (
	"bufio"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// echo serves lines back on a loopback listener wrapped in a Listener.
func echo(t *testing.T) *Listener {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	l := &Listener{Listener: inner}
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					_, _ = c.Write([]byte(line))
				}
			}()
		}
	}()
	return l
}

func roundTrip(t *testing.T, c net.Conn, msg string) error {
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(msg + "\n")); err != nil {
		return err
	}
	got, err := bufio.NewReader(c).ReadString('\n')
	if err == nil {
		assert.Equal(t, msg+"\n", got)
	}
	return err
}

func TestProxyForwardsAndCuts(t *testing.T) {
	server := echo(t)
	p, err := NewProxy(server.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })

	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, roundTrip(t, c, "hello"))
	assert.Equal(t, 1, p.Cut(), "one client connection")
	assert.Error(t, roundTrip(t, c, "after the cut"), "a cut connection is dead")

	c2, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c2.Close()
	require.NoError(t, roundTrip(t, c2, "reconnected"), "the proxy accepts new connections after a cut")
	assert.Equal(t, 2, server.Cut(), "the server saw both proxied connections")
}

// A stranded connection hears nothing more, not even a close, while the
// server's side is closed (the server sees its client leave); a new
// connection is forwarded.
func TestProxyStrandLeavesTheClientUnanswered(t *testing.T) {
	server := echo(t)
	p, err := NewProxy(server.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })

	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, roundTrip(t, c, "hello"))
	assert.Equal(t, 1, p.Strand(), "one connection stranded")
	assert.Equal(t, 0, p.Strand(), "a stranded connection is not stranded again")

	_ = c.SetDeadline(time.Now().Add(300 * time.Millisecond))
	_, err = c.Write([]byte("anyone?\n"))
	require.NoError(t, err, "the client's side is still open")
	_, err = bufio.NewReader(c).ReadString('\n')
	var ne net.Error
	require.ErrorAs(t, err, &ne, "no answer and no close: the read runs into its deadline")
	assert.True(t, ne.Timeout(), "a timeout, not an end of stream: %v", err)

	c2, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c2.Close()
	require.NoError(t, roundTrip(t, c2, "after"), "new connections are forwarded")
	assert.Equal(t, 2, p.Cut(), "Cut closes the stranded connection and the one forwarded since")
}

// While refusing, a new connection is closed at once and the connections
// already forwarded go on; afterwards new connections are forwarded again.
func TestProxyRefuseClosesNewConnections(t *testing.T) {
	server := echo(t)
	p, err := NewProxy(server.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })

	before, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer before.Close()
	require.NoError(t, roundTrip(t, before, "hello"))

	p.Refuse(true)
	refused, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err, "the port still accepts, as a host that resets would")
	defer refused.Close()
	assert.Error(t, roundTrip(t, refused, "anyone?"), "closed at once")
	require.NoError(t, roundTrip(t, before, "still here"), "a connection forwarded before goes on")

	p.Refuse(false)
	after, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer after.Close()
	require.NoError(t, roundTrip(t, after, "back"))
}

// A throttled proxy carries what a client sends no faster than its rate,
// however fast the client writes: 1 MiB at 512 KiB/s reaches the server
// in about two seconds, not at once.
func TestProxyThrottleCapsWhatClientsSend(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = inner.Close() })
	received := make(chan time.Time, 1)
	const size = 1 << 20
	go func() {
		c, err := inner.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		if _, err := io.ReadFull(c, make([]byte, size)); err == nil {
			received <- time.Now()
		}
	}()
	p, err := NewProxy(inner.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	p.Throttle(512 << 10)

	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c.Close()
	start := time.Now()
	go func() { _, _ = c.Write(make([]byte, size)) }()
	select {
	case at := <-received:
		// The rate's two seconds, less the sleep after the last chunk.
		assert.GreaterOrEqual(t, at.Sub(start), 1900*time.Millisecond)
	case <-time.After(time.Minute):
		t.Fatal("the throttled proxy did not carry 1 MiB within a minute")
	}
}
