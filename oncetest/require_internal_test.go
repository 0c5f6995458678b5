package oncetest

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// A query that cannot run (every connection of the pool held by the test,
// rows it never closed or a consumer left running; a lock it waits for)
// hung RequireEachOnce without a word until go test's -timeout panicked:
// it fails the test after requireTimeout, saying what it waited for.
func TestRequireEachOnceFailsWhenTheQueryCannotRun(t *testing.T) {
	pool := Postgres(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE seen (id text); INSERT INTO seen VALUES ('a')`); err != nil {
		t.Fatal(err)
	}
	held := holdEveryConnection(t, pool)
	defer func() {
		for _, c := range held {
			c.Release()
		}
	}()
	bound := requireTimeout
	requireTimeout = 200 * time.Millisecond
	defer func() { requireTimeout = bound }()

	failed := make(chan string, 1)
	go func() {
		failed <- FatalOf(t, func(tb testing.TB) { RequireEachOnce(tb, pool, `SELECT id FROM seen`, "a") })
	}()
	select {
	case msg := <-failed:
		if !strings.Contains(msg, "no answer within") {
			t.Fatalf("RequireEachOnce did not say that its query had no answer: %q", msg)
		}
		t.Logf("RequireEachOnce failed with: %s", msg)
	case <-time.After(30 * time.Second):
		t.Fatal("RequireEachOnce still waits for a connection 30 s later, with no word")
	}
}

// holdEveryConnection acquires each connection the pool may open.
func holdEveryConnection(t *testing.T, pool *pgxpool.Pool) []*pgxpool.Conn {
	t.Helper()
	var held []*pgxpool.Conn
	for range pool.Config().MaxConns {
		c, err := pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	return held
}
