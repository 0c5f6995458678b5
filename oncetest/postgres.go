package oncetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/internal/pgtemp"
)

var (
	serverOnce sync.Once
	serverURL  string
	serverErr  error
)

// URL returns the URL of the test server: DATABASE_URL when it is set,
// else a throwaway PostgreSQL started on first use (fsync off, on a free
// loopback port, as an unprivileged user when the test runs as root) and
// stopped, its files removed, when the test binary ends, however it ends.
// It fails the test when no server can be had.
func URL(t testing.TB) string {
	t.Helper()
	serverOnce.Do(func() {
		if serverURL = os.Getenv("DATABASE_URL"); serverURL != "" {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		srv, err := pgtemp.Start(ctx, pgtemp.Options{})
		if err != nil {
			serverErr = fmt.Errorf("oncetest: no PostgreSQL: set DATABASE_URL, or install the server binaries (Debian: apt-get install postgresql): %w", err)
			return
		}
		serverURL = srv.URL()
	})
	if serverErr != nil {
		t.Fatal(serverErr)
	}
	return serverURL
}

// Server is a throwaway PostgreSQL server, for a demo or a tool that needs
// one outside a test. Close stops it and removes its files; if the process
// dies first, the server stops by itself within a second or so.
type Server struct{ srv *pgtemp.Server }

// StartServer starts a throwaway PostgreSQL server from the machine's
// binaries ($PG_BINDIR, else the newest /usr/lib/postgresql/*/bin, else
// PATH). With durable set, fsync and synchronous_commit stay on, as in
// production.
func StartServer(ctx context.Context, durable bool) (*Server, error) {
	srv, err := pgtemp.Start(ctx, pgtemp.Options{Durable: durable})
	if err != nil {
		return nil, err
	}
	return &Server{srv: srv}, nil
}

// URL is the connection string of the server's "postgres" database.
func (s *Server) URL() string { return s.srv.URL() }

// Close stops the server and removes its files.
func (s *Server) Close() error { return s.srv.Close() }

var unsafeName = regexp.MustCompile(`[^a-z0-9_]+`)

// Postgres returns a pool whose connections use a schema made for this
// test (search_path), on the server of URL. The schema and the pool go
// when the test ends; a connection the test never released (a
// transaction left open) fails the test and is ended after 10 seconds, so
// that its locks do not keep the schema. Any other session still holding
// a lock in the schema then (a connection opened with the pool's config,
// left in a transaction) is ended too, and logged. A schema that still
// cannot be dropped fails the test. Tests using it may run in parallel.
func Postgres(t testing.TB) *pgxpool.Pool {
	t.Helper()
	url := URL(t)
	ctx := context.Background()
	admin, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatalf("oncetest: %v", err)
	}
	schema := schemaName(t)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		admin.Close()
		t.Fatalf("oncetest: create schema: %v", err)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("oncetest: %v", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	// The server processes of the pool's open connections, to end those
	// the test never released: their locks would keep the schema.
	var (
		mu   sync.Mutex
		pids = map[int64]bool{}
	)
	cfg.AfterConnect = func(_ context.Context, c *pgx.Conn) error {
		mu.Lock()
		defer mu.Unlock()
		pids[int64(c.PgConn().PID())] = true
		return nil
	}
	cfg.BeforeClose = func(c *pgx.Conn) {
		mu.Lock()
		defer mu.Unlock()
		delete(pids, int64(c.PgConn().PID()))
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("oncetest: %v", err)
	}
	t.Cleanup(func() {
		released := closeWithin(t, pool, 10*time.Second)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if !released {
			mu.Lock()
			open := slices.Collect(maps.Keys(pids))
			mu.Unlock()
			if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid`, open); err != nil {
				t.Errorf("oncetest: end the unreleased connections: %v", err)
			}
		}
		if err := dropSchema(ctx, t, admin, schema); err != nil {
			t.Errorf("oncetest: drop schema %s: %v; it is left on the server", schema, err)
		}
		admin.Close()
	})
	return pool
}

// dropSchema drops schema, ending the sessions (other than admin's) that
// hold locks in it and keep the drop waiting, until ctx ends.
func dropSchema(ctx context.Context, t testing.TB, admin *pgxpool.Pool, schema string) error {
	for {
		// lock_timeout, so that a session holding a lock is found and
		// ended rather than waited for up to ctx's end; above the default
		// deadlock_timeout (1 s), after which an autovacuum worker in the
		// way cancels itself.
		_, err := admin.Exec(ctx, "SET lock_timeout = '2s'; DROP SCHEMA "+schema+" CASCADE; RESET lock_timeout")
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
			return err
		}
		// The holders first, then their end: in one statement, PostgreSQL
		// may call pg_terminate_backend before the filter on the schema.
		// A lock on the schema itself is one too: a table created in a
		// transaction still open is not in pg_class for us. Client
		// sessions only: an autovacuum worker gives way by itself.
		rows, err := admin.Query(ctx, `SELECT DISTINCT l.pid::int8 FROM pg_locks l, pg_namespace n, pg_stat_activity a
			WHERE n.nspname = $1 AND a.pid = l.pid AND a.backend_type = 'client backend' AND l.pid <> pg_backend_pid()
			AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
			AND (l.relation IN (SELECT oid FROM pg_class WHERE relnamespace = n.oid)
				OR (l.classid = 'pg_namespace'::regclass AND l.objid = n.oid))`, schema)
		if err != nil {
			return err
		}
		ended, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return err
		}
		if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid`, ended); err != nil {
			return err
		}
		t.Logf("oncetest: ended the sessions %v, which held locks in schema %s after the test", ended, schema)
	}
}

// schemaName derives a unique schema name from the test's name.
func schemaName(t testing.TB) string {
	name := unsafeName.ReplaceAllString(strings.ToLower(t.Name()), "_")
	if len(name) > 40 {
		name = name[:40]
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	return "t_" + name + "_" + hex.EncodeToString(b[:])
}

// closeWithin closes pool, reporting instead of hanging on a connection
// the test never released (pgxpool.Close waits for every one). It reports
// whether every connection was closed.
func closeWithin(t testing.TB, pool *pgxpool.Pool, d time.Duration) bool {
	done := make(chan struct{})
	go func() { pool.Close(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(d):
		t.Errorf("oncetest: a connection was never released (a transaction neither committed nor rolled back, or rows not closed); ended it to drop the test's schema")
		return false
	}
}
