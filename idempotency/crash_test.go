package idempotency_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

// TestKilledChild is the service process of TestProcessKilledMidRequest:
// its handler writes the effect, says so on stdout, and never returns.
func TestKilledChild(t *testing.T) {
	if os.Getenv("ONCE_HTTP_CHILD_SCHEMA") == "" {
		t.Skip("run by TestProcessKilledMidRequest as its service process")
	}
	schema := os.Getenv("ONCE_HTTP_CHILD_SCHEMA")
	pool := pgtest.NewPool(t, schema)
	mw, err := idempotency.New(pool, idempotency.Config{Scope: idempotency.SingleScope, Schema: schema})
	require.NoError(t, err)
	h := func(w http.ResponseWriter, r *http.Request) {
		_, err := idempotency.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ($1, 'child')`, idempotency.Key(r.Context()))
		require.NoError(t, err)
		fmt.Println("IN-HANDLER")
		select {} // killed here
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	fmt.Println("LISTEN", ln.Addr().String())
	require.NoError(t, http.Serve(ln, mw.Handler(http.HandlerFunc(h))))
}

// A service process is killed (SIGKILL) while a request is in its handler,
// after the handler's write. Nothing stays pending: the database rolls the
// transaction back when the connection drops, so a retry of the same key
// against another process runs the handler, and the effect exists once.
// While the killed process was alive, the key was in flight (409).
func TestProcessKilledMidRequest(t *testing.T) {
	s := newService(t, idempotency.Config{Wait: time.Minute}, http.HandlerFunc(insertEffect))
	busy := serve(t, s.pool, s.schema, idempotency.Config{}, http.HandlerFunc(insertEffect)) // Wait 0

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestKilledChild$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), "ONCE_HTTP_CHILD_SCHEMA="+s.schema, "DATABASE_URL="+pgtest.URL())
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	lines := bufio.NewScanner(stdout)
	next := func(prefix string) string {
		for lines.Scan() {
			if line := lines.Text(); strings.HasPrefix(line, prefix) {
				return strings.TrimSpace(strings.TrimPrefix(line, prefix))
			}
		}
		t.Fatalf("the child ended before printing %q: %v", prefix, lines.Err())
		return ""
	}
	child := &service{t: t, url: "http://" + next("LISTEN"), client: noRetryClient}

	lost := make(chan error, 1)
	go func() { _, err := child.tryPost("/orders", "k", "b"); lost <- err }()
	next("IN-HANDLER")
	assert.Equal(t, http.StatusConflict, busy.post("/orders", "k", "b").status, "the key is in flight")
	assert.Equal(t, 0, s.effects(), "the child's write is not committed")

	require.NoError(t, cmd.Process.Kill())
	_ = cmd.Wait()
	require.Error(t, <-lost, "the client lost its request")

	// The retry waits, if it must, for the database to notice the dead
	// connection; then it claims the key and runs.
	r := s.post("/orders", "k", "b")
	require.Equal(t, http.StatusCreated, r.status, r.body)
	assert.False(t, r.replayed())
	assert.Equal(t, 1, s.effects())
	assert.Equal(t, 0, count(t, s.pool, `SELECT count(*) FROM effects WHERE body = 'child'`))
	assert.True(t, s.post("/orders", "k", "b").replayed())
}
