package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// service is a middleware in front of a handler, served over real HTTP,
// on a schema of its own with an effects table: one row per effect of a
// handler, with no unique key, so a double effect shows as two rows.
type service struct {
	t      *testing.T
	pool   *pgxpool.Pool
	schema string
	mw     *idempotency.Middleware
	url    string
	client *http.Client
}

func newService(t *testing.T, cfg idempotency.Config, h http.Handler) *service {
	t.Helper()
	pool, schema := pgtest.Schema(t)
	ctx := context.Background()
	require.NoError(t, idempotency.Migrate(ctx, pool, schema))
	_, err := pool.Exec(ctx, `CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, body text NOT NULL)`)
	require.NoError(t, err)
	// Room for every concurrent client of a test to hold a connection
	// while it waits on a key: pgxpool's default is 4.
	big := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.MaxConns = 60 })
	s := serve(t, big, schema, cfg, h)
	s.pool = pool
	return s
}

// serve puts a middleware configured by cfg in front of h, on the tables
// of schema.
func serve(t *testing.T, pool *pgxpool.Pool, schema string, cfg idempotency.Config, h http.Handler) *service {
	t.Helper()
	if cfg.Scope == nil {
		cfg.Scope = idempotency.SingleScope
	}
	cfg.Schema = schema
	mw, err := idempotency.New(pool, cfg)
	require.NoError(t, err)
	srv := httptest.NewServer(mw.Handler(h))
	t.Cleanup(srv.Close)
	return &service{t: t, pool: pool, schema: schema, mw: mw, url: srv.URL, client: client}
}

// insertEffect is the test's business write: one row in effects, in the
// request's transaction, answered with 201 and the row's id.
func insertEffect(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var id int64
	err = idempotency.Tx(r.Context()).QueryRow(r.Context(),
		`INSERT INTO effects (key, body) VALUES ($1, $2) RETURNING id`, idempotency.Key(r.Context()), string(body)).Scan(&id)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
	w.Header().Set("X-Request-Only", "not stored")
	w.WriteHeader(http.StatusCreated)
	_, _ = fmt.Fprintf(w, `{"id":%d}`, id)
}

// reply is what a client got.
type reply struct {
	status int
	header http.Header
	body   string
}

func (r reply) replayed() bool { return r.header.Get(idempotency.ReplayedHeader) == "true" }

var client = &http.Client{Timeout: time.Minute}

// noRetryClient uses a new connection per request: net/http's transport
// retries a request carrying an Idempotency-Key by itself when a reused
// connection breaks, which a test of a broken request must not get.
var noRetryClient = &http.Client{Timeout: time.Minute, Transport: &http.Transport{DisableKeepAlives: true}}

// post sends body to path with the key ("" for none) and extra headers
// given as name, value pairs. Tests call it from goroutines of their own,
// so a failed request is reported with Errorf and answered with the zero
// reply (status 0, which no test takes for an answer): FailNow there
// would end only that goroutine, and the test would wait for its reply
// until the binary's timeout instead of failing with the error.
func (s *service) post(path, key, body string, headers ...string) reply {
	s.t.Helper()
	rep, err := s.tryPost(path, key, body, headers...)
	if err != nil {
		s.t.Errorf("POST %s (key %q): %v", path, key, err)
		return reply{header: http.Header{}}
	}
	return rep
}

func (s *service) tryPost(path, key, body string, headers ...string) (reply, error) {
	req, err := http.NewRequest(http.MethodPost, s.url+path, strings.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	if key != "" {
		req.Header.Set(idempotency.DefaultHeader, key)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Add(headers[i], headers[i+1])
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, header: resp.Header, body: string(b)}, err
}

// effects counts the committed effects.
func (s *service) effects() int {
	s.t.Helper()
	return count(s.t, s.pool, `SELECT count(*) FROM effects`)
}

// keys counts the committed keys.
func (s *service) keys() int {
	s.t.Helper()
	return count(s.t, s.pool, `SELECT count(*) FROM idempotency_keys`)
}

func count(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// waitingClaims counts the claims of this service's schema that wait for a
// lock (a transaction holding the same key).
func (s *service) waitingClaims() int {
	s.t.Helper()
	return count(s.t, s.pool, `SELECT count(*) FROM pg_stat_activity
		WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'
		AND query LIKE 'SELECT pg_advisory_xact_lock%' AND strpos(query, '"' || $1 || '"."idempotency_keys"') > 0`, s.schema)
}

// gate blocks handlers until opened; a test that fails first cannot leave
// them blocked past a minute (the server's Close waits for them).
type gate struct {
	entered chan struct{}
	open    chan struct{}
}

func newGate() *gate { return &gate{entered: make(chan struct{}, 100), open: make(chan struct{})} }

// wrap returns h behind the gate: each request signals entered, then waits.
func (g *gate) wrap(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		g.entered <- struct{}{}
		select {
		case <-g.open:
		case <-time.After(time.Minute):
		}
		h(w, r)
	}
}

// waitEntered waits until a handler is behind the gate.
func (g *gate) waitEntered(t *testing.T) {
	t.Helper()
	select {
	case <-g.entered:
	case <-time.After(30 * time.Second):
		t.Fatal("no handler reached the gate")
	}
}

// unreachablePool is a pool whose server does not exist: a port that was
// free a moment ago.
func unreachablePool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	cfg, err := pgxpool.ParseConfig("postgres://nobody@" + addr + "/none?connect_timeout=2&sslmode=disable")
	require.NoError(t, err)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}
