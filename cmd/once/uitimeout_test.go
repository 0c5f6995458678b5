package main

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/internal/pgtest"
)

// once ui lets no client hold a connection for ever: a header sent a line
// at a time (slow loris), a body that never arrives and a keep-alive
// connection left idle are each closed within the server's bounds.
func TestUIClosesSlowAndIdleConnections(t *testing.T) {
	saved := uiTimeouts
	t.Cleanup(func() { uiTimeouts = saved })
	uiTimeouts = serverTimeouts{ReadHeader: 300 * time.Millisecond, Read: 600 * time.Millisecond,
		Write: 5 * time.Second, Idle: 600 * time.Millisecond}
	_, schema := pgtest.Schema(t)
	pr, pw := io.Pipe()
	a := newApp(pw, io.Discard, func(string) string { return "" })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	go func() {
		done <- a.run(ctx, []string{"ui", "-addr", "127.0.0.1:0", "-database-url", testenv.SchemaURL(schema)})
		pw.Close()
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			t.Error("once ui did not stop")
		}
	})
	line, err := bufio.NewReader(pr).ReadString('\n')
	require.NoError(t, err)
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	addr := strings.TrimSuffix(strings.TrimPrefix(strings.Fields(strings.TrimPrefix(line, "once console on "))[0], "http://"), "/")

	// closed waits until the server closes conn, reading what it sends,
	// and fails the test when it is still open after bound.
	closed := func(name string, conn net.Conn, bound time.Duration) {
		t.Helper()
		require.NoError(t, conn.SetReadDeadline(time.Now().Add(bound)))
		_, err := io.Copy(io.Discard, conn)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("%s: the connection was still open after %v", name, bound)
		}
	}
	dial := func() net.Conn {
		conn, err := net.Dial("tcp", addr)
		require.NoError(t, err)
		t.Cleanup(func() { conn.Close() })
		return conn
	}

	// A header a line every 100 ms, never ended.
	loris := dial()
	_, err = io.WriteString(loris, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
	require.NoError(t, err)
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
				if _, err := io.WriteString(loris, "X-Slow: 1\r\n"); err != nil {
					return
				}
			}
		}
	}()
	closed("a header sent slowly", loris, 5*time.Second)

	// A POST whose body never comes.
	body := dial()
	_, err = io.WriteString(body, "POST /replay HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"+
		"Content-Length: 1000\r\n\r\nq=0")
	require.NoError(t, err)
	closed("a body that never comes", body, 5*time.Second)

	// A keep-alive connection idle after its answer.
	idle := dial()
	_, err = io.WriteString(idle, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
	require.NoError(t, err)
	resp, err := http.ReadResponse(bufio.NewReader(idle), nil)
	require.NoError(t, err)
	_, err = io.Copy(io.Discard, resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.False(t, resp.Close, "the server keeps the connection open for another request")
	closed("an idle keep-alive connection", idle, 5*time.Second)
}
