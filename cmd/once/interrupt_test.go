package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A Ctrl-C asks a command to stop; while it is stuck in a broker call
// that does not watch the context (here a Kafka "broker" that accepts
// connections and never answers, which sarama waits out for minutes), a
// second Ctrl-C quits, as it does any program.
func TestSecondInterruptQuits(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	accepted := make(chan net.Conn, 64)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		for {
			select {
			case c := <-accepted:
				c.Close()
			default:
				return
			}
		}
	})

	cmd := exec.Command(os.Args[0], "dlq", "list", "-kafka", ln.Addr().String(), "-dlq", "orders.dlq")
	cmd.Env = append(os.Environ(), "ONCE_TEST_MAIN=1")
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	lines := make(chan string, 16)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		done <- cmd.Wait()
	}()
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	select {
	case c := <-accepted:
		accepted <- c // closed at cleanup
	case <-time.After(30 * time.Second):
		t.Fatal("the command never connected to the broker")
	}
	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	var said []string
	stopping := false
	timeout := time.After(10 * time.Second)
	for !stopping {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("the command ended on the first interrupt: %q", said)
			}
			said = append(said, l)
			stopping = strings.Contains(l, "stopping")
		case <-timeout:
			t.Errorf("no word on stderr that the interrupt was taken: %q", said)
			stopping = true
		}
	}
	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	select {
	case err := <-done:
		assert.Error(t, err, "killed by the second interrupt")
	case <-time.After(10 * time.Second):
		t.Fatal("still running 10s after a second interrupt")
	}
}

// once ui stops promptly and cleanly on its interrupt also while a page
// waits on a broker that does not answer: the requests in flight end with
// the command's context, rather than the shutdown giving up on them after
// its own timeout with an error.
func TestUIStopsWhileAPageWaitsOnABroker(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	accepted := make(chan net.Conn, 64)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		for {
			select {
			case c := <-accepted:
				c.Close()
			default:
				return
			}
		}
	})
	pr, pw := io.Pipe()
	var errb bytes.Buffer
	a := newApp(pw, &errb, func(string) string { return "" })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan int, 1)
	go func() {
		done <- a.run(ctx, []string{"ui", "-addr", "127.0.0.1:0", "-kafka", ln.Addr().String(), "-dlq", "orders.dlq"})
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	require.NoError(t, err)
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	addr := strings.Fields(strings.TrimPrefix(line, "once console on "))[0]
	go func() {
		if resp, err := http.Get(addr); err == nil {
			resp.Body.Close()
		}
	}()
	select {
	case c := <-accepted:
		accepted <- c // the page waits on the broker; closed at cleanup
	case <-time.After(30 * time.Second):
		t.Fatal("the page never connected to the broker")
	}
	start := time.Now()
	cancel()
	select {
	case code := <-done:
		assert.Equal(t, exitOK, code, errb.String())
		assert.Less(t, time.Since(start), 5*time.Second)
	case <-time.After(30 * time.Second):
		t.Fatal("once ui did not stop")
	}
}
