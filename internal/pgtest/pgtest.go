// Package pgtest gives tests a real PostgreSQL database: the one at
// DATABASE_URL, or a throwaway server started for the test binary. Each test
// gets a schema of its own, dropped when it ends, so tests run in parallel.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/internal/pgtemp"
)

var url string

// Main runs the package's tests against DATABASE_URL, or against a
// throwaway server that it starts and removes (with fsync off, unless
// ONCE_PG_DURABLE=1). Call it from TestMain.
func Main(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	url = os.Getenv("DATABASE_URL")
	if url == "" {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		// Benchmarks set ONCE_PG_DURABLE=1 for production-like fsync.
		srv, err := pgtemp.Start(ctx, pgtemp.Options{Durable: os.Getenv("ONCE_PG_DURABLE") == "1"})
		cancel()
		if err != nil {
			fmt.Fprintln(os.Stderr, "pgtest:", err)
			return 1
		}
		defer srv.Close()
		url = srv.URL()
	}
	return m.Run()
}

// URL returns the database URL the tests use. It is empty outside Main.
func URL() string { return url }

var unsafe = regexp.MustCompile(`[^a-z0-9_]+`)

// Schema creates a schema for this test and returns its name and a pool
// whose search_path is that schema. Both are removed when the test ends.
func Schema(t testing.TB) (*pgxpool.Pool, string) {
	t.Helper()
	if url == "" {
		t.Fatal("pgtest: no database; call pgtest.Main from TestMain")
	}
	ctx := context.Background()
	name := unsafe.ReplaceAllString(strings.ToLower(t.Name()), "_")
	if len(name) > 40 {
		name = name[:40]
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	schema := "t_" + name + "_" + hex.EncodeToString(b[:])

	admin, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		admin.Close()
		t.Fatalf("pgtest: create schema: %v", err)
	}
	pool := NewPool(t, schema)
	t.Cleanup(func() {
		closePool(t, pool, closeTimeout)
		// A connection never released may hold locks in the schema: do
		// not wait for it forever.
		ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
		defer cancel()
		_, _ = admin.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
		admin.Close()
	})
	return pool, schema
}

// closeTimeout bounds how long the end of a test waits for the
// connections it did not release.
const closeTimeout = 10 * time.Second

// closePool closes pool, waiting at most d for connections still in use:
// pgxpool.Close waits for every acquired connection, so a test that failed
// (or forgot) before releasing one would otherwise hang until the test
// binary's timeout. Such a connection is reported as a test error.
func closePool(t testing.TB, pool *pgxpool.Pool, d time.Duration) {
	done := make(chan struct{})
	go func() {
		pool.Close()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Errorf("pgtest: a connection of the test's pool was never released (a transaction neither committed nor rolled back, or rows not closed); went on after %s", d)
	}
}

// NewPool opens another pool on the test database with search_path set to
// schema; it is closed when the test ends.
func NewPool(t testing.TB, schema string) *pgxpool.Pool {
	t.Helper()
	return NewPoolWith(t, schema, nil)
}

// NewPoolWith is NewPool with configure applied to the pool's
// configuration first (a tracer, a query exec mode); configure may be nil.
func NewPoolWith(t testing.TB, schema string, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	if configure != nil {
		configure(cfg)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() { closePool(t, pool, closeTimeout) })
	return pool
}

// TurnReadOnly makes every connection of pool, which must hold none
// acquired, refuse writes (default_transaction_read_only = on), as the
// connections a pool kept to a primary that a failover fenced: they fail
// every write with 25006 until they are closed. New connections are not
// affected.
func TurnReadOnly(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	var conns []*pgxpool.Conn
	for range pool.Config().MaxConns {
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatalf("pgtest: acquire: %v", err)
		}
		conns = append(conns, c)
		if _, err := c.Exec(ctx, `SET default_transaction_read_only = on`); err != nil {
			t.Fatalf("pgtest: turn a connection read-only: %v", err)
		}
	}
	for _, c := range conns {
		c.Release()
	}
}
