package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/onceco/once/cmd/once/internal/testenv"
)

// A -database-url whose server accepts the connection and never answers
// (a wrong port, a firewall, a hung server) fails the command with exit 1
// within the connect timeout, saying so, when the URL sets none; once ui
// with dead letters to show goes on to serve them.
func TestDatabaseThatNeverAnswersFailsWithinTheConnectTimeout(t *testing.T) {
	saved := dbConnectTimeout
	t.Cleanup(func() { dbConnectTimeout = saved })
	dbConnectTimeout = 500 * time.Millisecond
	addr, _ := testenv.SilentBroker(t)
	url := "postgres://nobody@" + addr + "/none?sslmode=disable"
	for _, args := range [][]string{{"status"}, {"migrate", "status"}, {"retention", "-consumer", "billing", "-older-than", "1h"}} {
		var out, errb bytes.Buffer
		a := newApp(&out, &errb, func(k string) string {
			if k == "DATABASE_URL" {
				return url
			}
			return ""
		})
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		started := time.Now()
		code := a.run(ctx, args)
		cancel()
		assert.Less(t, time.Since(started), 10*time.Second, "%v waited for the silent server", args)
		assert.Equal(t, exitFailure, code, "%v: %s", args, errb.String())
		assert.Contains(t, errb.String(), "connect to PostgreSQL", args)
		assert.Contains(t, errb.String(), "no answer within 500ms", args)
	}

	pr, pw := io.Pipe()
	var errb syncBuffer
	a := newApp(pw, &errb, func(string) string { return "" })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	go func() {
		done <- a.run(ctx, []string{"ui", "-addr", "127.0.0.1:0", "-database-url", url, "-kafka", "127.0.0.1:1", "-dlq", "orders.dlq"})
		pw.Close()
	}()
	started := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(pr).ReadString('\n')
		started <- line
		_, _ = io.Copy(io.Discard, pr)
	}()
	select {
	case line := <-started:
		assert.Contains(t, line, "once console on", "once ui did not start: %s", errb.String())
	case <-time.After(10 * time.Second):
		t.Error("once ui waited for the silent server")
	}
	cancel()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		t.Fatal("once ui did not stop")
	}
	assert.Contains(t, errb.String(), "no answer within 500ms")
}

// syncBuffer is a bytes.Buffer safe for a writer and a reader at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
