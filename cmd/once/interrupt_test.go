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

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// runOnce starts the test binary as the once command (ONCE_TEST_MAIN=mode)
// with args and returns it, with its stderr lines and its end.
func runOnce(t *testing.T, mode string, args ...string) (*exec.Cmd, <-chan string, <-chan error) {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "ONCE_TEST_MAIN="+mode)
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
	return cmd, lines, done
}

// A Ctrl-C stops a command also while it waits on a broker that accepts
// connections and never answers (whose client, left to itself, waits out
// its own timeouts for minutes): it ends at once, with exit 1.
func TestInterruptStopsACommandWaitingOnABroker(t *testing.T) {
	addr, accepted := testenv.SilentBroker(t)
	cmd, lines, done := runOnce(t, "1", "dlq", "list", "-kafka", addr, "-dlq", "orders.dlq")
	select {
	case <-accepted:
	case <-time.After(30 * time.Second):
		t.Fatal("the command never connected to the broker")
	}
	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	select {
	case err := <-done:
		var said []string
		for l := range lines {
			said = append(said, l)
		}
		var exit *exec.ExitError
		require.ErrorAs(t, err, &exit)
		assert.Equal(t, exitFailure, exit.ExitCode())
		assert.Contains(t, strings.Join(said, "\n"), "context canceled")
	case <-time.After(10 * time.Second):
		t.Fatal("still running 10s after the interrupt")
	}
}

// A command stuck in a call that does not watch its context stops at a
// second Ctrl-C, as any program does: the first is taken ("stopping"),
// and must not leave the command impossible to interrupt.
func TestSecondInterruptQuits(t *testing.T) {
	cmd, lines, done := runOnce(t, "stuck")
	var said []string
	wait := func(word string) {
		t.Helper()
		timeout := time.After(10 * time.Second)
		for {
			select {
			case l, ok := <-lines:
				if !ok {
					t.Fatalf("the command ended waiting for %q: %q", word, said)
				}
				said = append(said, l)
				if strings.Contains(l, word) {
					return
				}
			case <-timeout:
				t.Fatalf("no %q on stderr: %q", word, said)
			}
		}
	}
	wait("stuck")
	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	wait("stopping")
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

// once status interrupted while a broker does not answer (here the lag's
// Kafka broker accepts connections and never answers) stops at once,
// printing what it read before: the consumers.
func TestStatusStopsWhenInterruptedWhileABrokerDoesNotAnswer(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background(), pool))
	_, err = pool.Exec(context.Background(), "INSERT INTO processed_events (consumer, event_id) VALUES ('billing', 'e-1')")
	require.NoError(t, err)
	for _, broker := range []string{"kafka", "amqp"} {
		t.Run(broker, func(t *testing.T) {
			addr, accepted := testenv.SilentBroker(t)
			args := []string{"status", "-database-url", testenv.SchemaURL(schema), "-kafka", addr, "-group", "g", "-topic", "orders"}
			if broker == "amqp" {
				args = []string{"status", "-database-url", testenv.SchemaURL(schema), "-amqp", "amqp://guest:guest@" + addr + "/", "-queue", "orders"}
			}
			var out, errb bytes.Buffer
			a := newApp(&out, &errb, func(string) string { return "" })
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan int, 1)
			go func() { done <- a.run(ctx, args) }()
			select {
			case <-accepted:
			case <-time.After(30 * time.Second):
				t.Fatal("never connected to the broker")
			}
			cancel()
			select {
			case code := <-done:
				assert.Equal(t, exitFailure, code)
				assert.Contains(t, out.String(), "billing", "what was read is printed")
				assert.Contains(t, errb.String(), "context canceled")
			case <-time.After(5 * time.Second):
				t.Fatal("still running 5s after the interrupt")
			}
		})
	}
}

// once ui stops cleanly on its interrupt also while a client holds a
// request unfinished (here the body of a replay's form, which it announced
// and never sends; a response it does not read is the same): the shutdown
// gives such a connection its grace and then closes it. It gave up after
// its grace with "context deadline exceeded" instead, and the stop the
// user asked for exited 1, as a failure.
func TestUIStopsCleanlyWhileAClientHoldsItsRequest(t *testing.T) {
	addr, _ := testenv.SilentBroker(t)
	pr, pw := io.Pipe()
	var errb syncBuffer // the handler logs its failed read as the server closes the connection
	a := newApp(pw, &errb, func(string) string { return "" })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan int, 1)
	go func() {
		done <- a.run(ctx, []string{"ui", "-addr", "127.0.0.1:0", "-allow-replay", "-kafka", addr, "-dlq", "orders.dlq"})
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	require.NoError(t, err)
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	host := strings.TrimSuffix(strings.TrimPrefix(strings.Fields(strings.TrimPrefix(line, "once console on "))[0], "http://"), "/")
	c, err := net.Dial("tcp", host)
	require.NoError(t, err)
	defer c.Close()
	// The server answers "100 Continue" once the handler reads the body.
	_, err = io.WriteString(c, "POST /replay HTTP/1.1\r\nHost: "+host+"\r\nContent-Type: application/x-www-form-urlencoded\r\n"+
		"Content-Length: 10\r\nExpect: 100-continue\r\n\r\n")
	require.NoError(t, err)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
	status, err := bufio.NewReader(c).ReadString('\n')
	require.NoError(t, err)
	require.Contains(t, status, "100 Continue", "the handler reads the form")
	start := time.Now()
	cancel()
	select {
	case code := <-done:
		assert.Equal(t, exitOK, code, errb.String())
		assert.Less(t, time.Since(start), 15*time.Second)
	case <-time.After(30 * time.Second):
		t.Fatal("once ui did not stop")
	}
}
