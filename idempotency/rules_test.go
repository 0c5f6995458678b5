package idempotency_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/netcut"
	"github.com/onceco/once/internal/pgtest"
)

// A repeated key gets the stored response: same status, stored headers and
// body, marked as a replay; the handler does not run again.
func TestReplayReturnsStoredResponse(t *testing.T) {
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	first := s.post("/orders", "k-1", `{"item":"book"}`)
	require.Equal(t, http.StatusCreated, first.status, first.body)
	assert.False(t, first.replayed())
	assert.Equal(t, "not stored", first.header.Get("X-Request-Only"), "the first response carries every header")

	for range 3 {
		again := s.post("/orders", "k-1", `{"item":"book"}`)
		assert.Equal(t, http.StatusCreated, again.status)
		assert.True(t, again.replayed())
		assert.Equal(t, first.body, again.body)
		assert.Equal(t, first.header.Get("Location"), again.header.Get("Location"))
		assert.Equal(t, "application/json", again.header.Get("Content-Type"))
		assert.Empty(t, again.header.Get("X-Request-Only"), "only StoredHeaders are replayed")
	}
	assert.Equal(t, 1, s.effects())
	assert.Equal(t, 1, s.keys())

	other := s.post("/orders", "k-2", `{"item":"book"}`)
	assert.Equal(t, http.StatusCreated, other.status)
	assert.NotEqual(t, first.body, other.body, "another key is another order")
	assert.Equal(t, 2, s.effects())
}

// The draft's form of the key, a quoted Structured Field String, names the
// same key as the bare form clients such as Stripe's send.
func TestQuotedAndBareKeysAreTheSameKey(t *testing.T) {
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	first := s.post("/orders", `"8e03978e-40d5"`, "x")
	require.Equal(t, http.StatusCreated, first.status)
	again := s.post("/orders", `8e03978e-40d5`, "x")
	assert.True(t, again.replayed())
	assert.Equal(t, first.body, again.body)
	assert.Equal(t, 1, s.effects())
}

// Many clients send the same key at once, while the first request is in
// its handler: with a wait longer than the handler, every one of them gets
// the first's response, and the effect happens once.
func TestConcurrentRetriesRunTheEffectOnce(t *testing.T) {
	const clients = 40
	g := newGate()
	s := newService(t, idempotency.Config{Wait: time.Minute}, g.wrap(insertEffect))

	replies := make([]reply, clients)
	var wg sync.WaitGroup
	for i := range clients {
		wg.Go(func() { replies[i] = s.post("/orders", "same-key", `{"item":"lamp"}`) })
	}
	g.waitEntered(t)
	// Every other request is waiting on the first's claim before the
	// first may finish: the wait is what is under test.
	require.Eventually(t, func() bool { return s.waitingClaims() == clients-1 }, 30*time.Second, 5*time.Millisecond)
	close(g.open)
	wg.Wait()

	fresh := 0
	for _, r := range replies {
		require.Equal(t, http.StatusCreated, r.status, r.body)
		assert.Equal(t, replies[0].body, r.body)
		if !r.replayed() {
			fresh++
		}
	}
	assert.Equal(t, 1, fresh, "one response is the handler's, the others replays")
	assert.Equal(t, 1, s.effects())
}

// Under repeatable read, a request that waited for the first still gets
// its response: its own snapshot predates the first's commit, so the claim
// is tried again in a new transaction.
func TestWaiterUnderRepeatableReadGetsTheReplay(t *testing.T) {
	g := newGate()
	s := newService(t, idempotency.Config{Wait: time.Minute, TxOptions: pgx.TxOptions{IsoLevel: pgx.RepeatableRead}},
		g.wrap(insertEffect))
	first := make(chan reply, 1)
	go func() { first <- s.post("/orders", "k", "b") }()
	g.waitEntered(t)
	second := make(chan reply, 1)
	go func() { second <- s.post("/orders", "k", "b") }()
	require.Eventually(t, func() bool { return s.waitingClaims() == 1 }, 30*time.Second, 5*time.Millisecond)
	close(g.open)
	a, b := <-first, <-second
	require.Equal(t, http.StatusCreated, a.status, a.body)
	assert.Equal(t, http.StatusCreated, b.status, b.body)
	assert.True(t, b.replayed())
	assert.Equal(t, a.body, b.body)
	assert.Equal(t, 1, s.effects())
}

// With no wait (the default), a request whose key is in flight gets 409 at
// once, with Retry-After; after the first commits, a retry gets its
// response.
func TestInFlightKeyGets409(t *testing.T) {
	const clients = 20
	g := newGate()
	s := newService(t, idempotency.Config{}, g.wrap(insertEffect))

	first := make(chan reply, 1)
	go func() { first <- s.post("/orders", "busy", "b") }()
	g.waitEntered(t)

	var wg sync.WaitGroup
	replies := make([]reply, clients)
	for i := range clients {
		wg.Go(func() { replies[i] = s.post("/orders", "busy", "b") })
	}
	wg.Wait() // they all end while the first holds the key
	for _, r := range replies {
		assert.Equal(t, http.StatusConflict, r.status, r.body)
		assert.Equal(t, "1", r.header.Get("Retry-After"))
		assert.Equal(t, "application/problem+json", r.header.Get("Content-Type"))
	}
	close(g.open)
	got := <-first
	require.Equal(t, http.StatusCreated, got.status)
	again := s.post("/orders", "busy", "b")
	assert.True(t, again.replayed())
	assert.Equal(t, got.body, again.body)
	assert.Equal(t, 1, s.effects())
}

// Only the same key in flight is a 409: many clients placing new keys at
// once, with no wait, all succeed, whatever other locks their inserts meet
// (the table extended under concurrent inserts, say).
func TestConcurrentNewKeysAreNeverInFlight(t *testing.T) {
	const clients, each = 32, 25
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	var wg sync.WaitGroup
	var mu sync.Mutex
	statuses := map[int]int{}
	for c := range clients {
		wg.Go(func() {
			for i := range each {
				r := s.post("/orders", fmt.Sprintf("c%d-%d", c, i), strings.Repeat("x", 2000))
				mu.Lock()
				statuses[r.status]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	assert.Equal(t, map[int]int{http.StatusCreated: clients * each}, statuses)
	assert.Equal(t, clients*each, s.effects())
}

// A wait that ends before the first request does gives 409, not a second
// run.
func TestInFlightWaitTimesOut(t *testing.T) {
	g := newGate()
	s := newService(t, idempotency.Config{Wait: 300 * time.Millisecond}, g.wrap(insertEffect))
	first := make(chan reply, 1)
	go func() { first <- s.post("/orders", "slow", "b") }()
	g.waitEntered(t)

	start := time.Now()
	r := s.post("/orders", "slow", "b")
	assert.Equal(t, http.StatusConflict, r.status, r.body)
	assert.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond, "it waited before giving up")
	close(g.open)
	assert.Equal(t, http.StatusCreated, (<-first).status)
	assert.Equal(t, 1, s.effects())
}

// A request waiting on a key whose first request fails (5xx: rolled back)
// claims the key itself and runs: the failure left nothing pending.
func TestWaiterRunsWhenTheFirstRollsBack(t *testing.T) {
	g := newGate()
	var mu sync.Mutex
	calls := 0
	h := func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls++
		n := calls
		mu.Unlock()
		if n == 1 {
			g.entered <- struct{}{}
			<-g.open
			_, err := idempotency.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ('lost', '')`)
			assert.NoError(t, err)
			http.Error(w, "dependency down", http.StatusBadGateway)
			return
		}
		insertEffect(w, r)
	}
	s := newService(t, idempotency.Config{Wait: time.Minute}, http.HandlerFunc(h))
	first := make(chan reply, 1)
	go func() { first <- s.post("/orders", "k", "b") }()
	g.waitEntered(t)
	second := make(chan reply, 1)
	go func() { second <- s.post("/orders", "k", "b") }()
	require.Eventually(t, func() bool { return s.waitingClaims() == 1 }, 30*time.Second, 5*time.Millisecond)
	close(g.open)

	assert.Equal(t, http.StatusBadGateway, (<-first).status)
	r := <-second
	assert.Equal(t, http.StatusCreated, r.status, r.body)
	assert.False(t, r.replayed())
	assert.Equal(t, 1, s.effects(), "the failed request's write was rolled back")
	assert.Equal(t, 0, count(t, s.pool, `SELECT count(*) FROM effects WHERE key = 'lost'`))
}

// The same key for another request (body, path or query) is a 422, and
// the handler does not run.
func TestKeyReusedForAnotherRequestGets422(t *testing.T) {
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	require.Equal(t, http.StatusCreated, s.post("/orders", "k", `{"n":1}`).status)
	for _, c := range []struct{ path, body string }{
		{"/orders", `{"n":2}`}, {"/refunds", `{"n":1}`}, {"/orders?dry=1", `{"n":1}`},
	} {
		r := s.post(c.path, "k", c.body)
		assert.Equal(t, http.StatusUnprocessableEntity, r.status, "%s %s", c.path, c.body)
		assert.Equal(t, "application/problem+json", r.header.Get("Content-Type"))
	}
	assert.Equal(t, 1, s.effects())
}

// A Fingerprint of the business fields only lets a retry that differs in
// other ways (a client timestamp) replay.
func TestCustomFingerprint(t *testing.T) {
	fp := func(r *http.Request, body []byte) []byte {
		var v struct{ Item string }
		_ = json.Unmarshal(body, &v)
		return []byte(r.URL.Path + "\x00" + v.Item)
	}
	s := newService(t, idempotency.Config{Fingerprint: fp}, http.HandlerFunc(insertEffect))
	require.Equal(t, http.StatusCreated, s.post("/orders", "k", `{"item":"a","sent":1}`).status)
	assert.True(t, s.post("/orders", "k", `{"item":"a","sent":2}`).replayed())
	assert.Equal(t, http.StatusUnprocessableEntity, s.post("/orders", "k", `{"item":"b","sent":3}`).status)
	assert.Equal(t, 1, s.effects())
}

// A route that requires a key answers 400 without one, or with one that is
// not a key; the handler does not run.
func TestMissingOrInvalidKeyGets400(t *testing.T) {
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	for name, key := range map[string]string{
		"missing":      "",
		"too long":     strings.Repeat("k", idempotency.MaxKeyLength+1),
		"not ascii":    "clé",
		"bad quoting":  `"abc`,
		"after quote":  `"abc"def`,
		"bad escape":   `"a\b"`,
		"empty quoted": `""`,
	} {
		r := s.post("/orders", key, "b")
		assert.Equal(t, http.StatusBadRequest, r.status, name)
		assert.Equal(t, "application/problem+json", r.header.Get("Content-Type"), name)
	}
	r := s.post("/orders", "", "b", idempotency.DefaultHeader, "a", idempotency.DefaultHeader, "b")
	assert.Equal(t, http.StatusBadRequest, r.status, "two keys")
	assert.Equal(t, http.StatusCreated, s.post("/orders", strings.Repeat("k", idempotency.MaxKeyLength), "b").status)
	assert.Equal(t, 1, s.effects())
}

// With Optional, a request without a key runs in a transaction with no
// claim: committed, and run again on a retry.
func TestOptionalKey(t *testing.T) {
	s := newService(t, idempotency.Config{Optional: true}, http.HandlerFunc(insertEffect))
	assert.Equal(t, http.StatusCreated, s.post("/orders", "", "b").status)
	assert.Equal(t, http.StatusCreated, s.post("/orders", "", "b").status)
	assert.Equal(t, 2, s.effects())
	assert.Equal(t, 0, s.keys())
	assert.Equal(t, http.StatusCreated, s.post("/orders", "k", "b").status)
	assert.True(t, s.post("/orders", "k", "b").replayed())
	assert.Equal(t, 3, s.effects())
}

// Keys are per client: two clients with the same key each get their own
// effect and their own response, never the other's.
func TestKeysAreScopedPerClient(t *testing.T) {
	scope := func(r *http.Request) string { return r.Header.Get("X-Client") }
	s := newService(t, idempotency.Config{Scope: scope}, http.HandlerFunc(insertEffect))
	alice := s.post("/orders", "k", "b", "X-Client", "alice")
	bob := s.post("/orders", "k", "b", "X-Client", "bob")
	require.Equal(t, http.StatusCreated, alice.status)
	require.Equal(t, http.StatusCreated, bob.status)
	assert.False(t, bob.replayed())
	assert.NotEqual(t, alice.body, bob.body)
	assert.Equal(t, alice.body, s.post("/orders", "k", "b", "X-Client", "alice").body)
	assert.Equal(t, bob.body, s.post("/orders", "k", "b", "X-Client", "bob").body)
	assert.Equal(t, 2, s.effects())
}

// An expired key is free again, whether or not retention removed it.
func TestExpiredKeyRunsAgain(t *testing.T) {
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	first := s.post("/orders", "k", "b")
	require.Equal(t, http.StatusCreated, first.status)
	var expires time.Time
	require.NoError(t, s.pool.QueryRow(context.Background(), `SELECT expires_at FROM idempotency_keys`).Scan(&expires))
	assert.WithinDuration(t, time.Now().Add(idempotency.DefaultTTL), expires, time.Minute, "24h by default")

	_, err := s.pool.Exec(context.Background(), `UPDATE idempotency_keys SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	again := s.post("/orders", "k", "other body") // a new request: no 422 either
	require.Equal(t, http.StatusCreated, again.status)
	assert.False(t, again.replayed())
	assert.NotEqual(t, first.body, again.body)
	assert.Equal(t, again.body, s.post("/orders", "k", "other body").body)
	assert.Equal(t, 2, s.effects())
	assert.Equal(t, 1, s.keys())
}

// Retention deletes expired keys only, in statements of RetentionBatch
// rows.
func TestRetentionDeletesExpiredKeysInBatches(t *testing.T) {
	s := newService(t, idempotency.Config{RetentionBatch: 7, RetentionInterval: 10 * time.Millisecond}, http.HandlerFunc(insertEffect))
	for i := range 25 {
		require.Equal(t, http.StatusCreated, s.post("/orders", "k"+string(rune('a'+i)), "b").status)
	}
	ctx := context.Background()
	_, err := s.pool.Exec(ctx, `UPDATE idempotency_keys SET expires_at = now() - interval '1 second' WHERE idempotency_key < 'kt'`)
	require.NoError(t, err)
	n, err := s.mw.DeleteExpired(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 19, n)
	assert.Equal(t, 6, s.keys())

	// RunRetention does the same on its interval, until cancelled.
	_, err = s.pool.Exec(ctx, `UPDATE idempotency_keys SET expires_at = now() - interval '1 second' WHERE idempotency_key < 'kw'`)
	require.NoError(t, err)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- s.mw.RunRetention(rctx) }()
	require.Eventually(t, func() bool { return s.keys() == 3 }, 30*time.Second, 10*time.Millisecond)
	cancel()
	assert.ErrorIs(t, <-done, context.Canceled)
}

// A table partitioned by scope (a partition per large client; its key
// (scope, idempotency_key) holds the partition key, and Migrate takes the
// table as it is) has rows of the same ctid in each partition: retention
// named rows by ctid alone, and took with each expired key the keys of
// that ctid in the other partitions, however young, whose requests then
// ran again. Only expired keys go now.
func TestRetentionOnPartitionedTable(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE idempotency_keys (
    scope           text        NOT NULL,
    idempotency_key text        NOT NULL,
    fingerprint     bytea,
    method          text        NOT NULL DEFAULT '',
    path            text        NOT NULL DEFAULT '',
    status          integer     NOT NULL DEFAULT 0,
    header          jsonb       NOT NULL DEFAULT '{}',
    body            bytea       NOT NULL DEFAULT '',
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (scope, idempotency_key)
) PARTITION BY LIST (scope);
CREATE TABLE idempotency_keys_big PARTITION OF idempotency_keys FOR VALUES IN ('big');
CREATE TABLE idempotency_keys_rest PARTITION OF idempotency_keys DEFAULT;
CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, body text NOT NULL)`)
	require.NoError(t, err)
	require.NoError(t, idempotency.Migrate(ctx, pool, schema))
	scope := func(r *http.Request) string { return r.Header.Get("X-Client") }
	s := serve(t, pool, schema, idempotency.Config{Scope: scope, RetentionBatch: 30}, http.HandlerFunc(insertEffect))
	first := make([]reply, 10)
	for i := range first {
		first[i] = s.post("/orders", fmt.Sprint("k", i), "b", "X-Client", "small")
		require.Equal(t, http.StatusCreated, first[i].status, first[i].body)
	}
	_, err = pool.Exec(ctx, `INSERT INTO idempotency_keys (scope, idempotency_key, status, expires_at)
SELECT 'big', 'old-' || i, 201, now() - interval '1 day' FROM generate_series(1, 100) i`)
	require.NoError(t, err)

	n, err := s.mw.DeleteExpired(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 100, n)
	assert.Equal(t, 10, count(t, pool, `SELECT count(*) FROM idempotency_keys`), "the young keys are kept")
	for i, want := range first {
		again := s.post("/orders", fmt.Sprint("k", i), "b", "X-Client", "small")
		assert.True(t, again.replayed(), "k%d", i)
		assert.Equal(t, want.body, again.body)
	}
	assert.Equal(t, 10, count(t, pool, `SELECT count(*) FROM effects`), "no request ran twice")
}

// A table made by hand without a unique key on (scope, idempotency_key),
// as one partitioned by creation time must be (PostgreSQL wants the
// partition key in every unique key, so the key becomes (scope,
// idempotency_key, created_at)), takes every claim: Migrate adopts any
// table of the name, and the claim's ON CONFLICT without a target found
// no conflict, so a retry of a completed request ran its handler again.
// The claim names its key now, and such a table is refused at each
// request (500) rather than a request ever running twice; Migrate refuses
// it too, and only a table whose DDL another tool ran gets that far.
func TestTableWithoutTheKeyNeverRunsARequestTwice(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE idempotency_keys (
    scope           text        NOT NULL,
    idempotency_key text        NOT NULL,
    fingerprint     bytea,
    method          text        NOT NULL DEFAULT '',
    path            text        NOT NULL DEFAULT '',
    status          integer     NOT NULL DEFAULT 0,
    header          jsonb       NOT NULL DEFAULT '{}',
    body            bytea       NOT NULL DEFAULT '',
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (scope, idempotency_key, created_at)
) PARTITION BY RANGE (created_at);
CREATE TABLE idempotency_keys_all PARTITION OF idempotency_keys DEFAULT;
CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, body text NOT NULL)`)
	require.NoError(t, err)
	err = idempotency.Migrate(ctx, pool, schema)
	require.ErrorIs(t, err, idempotency.ErrSchemaMismatch)
	assert.Contains(t, err.Error(), "no primary key or unique index on (scope, idempotency_key)")
	s := serve(t, pool, schema, idempotency.Config{}, http.HandlerFunc(insertEffect))
	ran := 0
	for range 3 {
		rep := s.post("/orders", "k", "b")
		if rep.status < 500 && !rep.replayed() {
			ran++
		}
	}
	assert.LessOrEqual(t, ran, 1, "answered by the handler")
	assert.LessOrEqual(t, count(t, pool, `SELECT count(*) FROM effects`), 1, "the handler's effects")
}

// A 5xx is not stored and its writes roll back: the retry runs and can
// succeed. A 4xx is the answer to the request: stored and replayed.
func TestStatusPolicy(t *testing.T) {
	var mu sync.Mutex
	fail := map[string]int{"flaky": http.StatusServiceUnavailable, "invalid": http.StatusConflict}
	h := func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		status := fail[idempotency.Key(r.Context())]
		delete(fail, idempotency.Key(r.Context()))
		mu.Unlock()
		if status == 0 {
			insertEffect(w, r)
			return
		}
		_, err := idempotency.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ('failed', '')`)
		assert.NoError(t, err)
		http.Error(w, "no", status)
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))

	assert.Equal(t, http.StatusServiceUnavailable, s.post("/orders", "flaky", "b").status)
	assert.Equal(t, 0, s.effects(), "the 5xx's write rolled back")
	retry := s.post("/orders", "flaky", "b")
	assert.Equal(t, http.StatusCreated, retry.status)
	assert.False(t, retry.replayed())

	assert.Equal(t, http.StatusConflict, s.post("/orders", "invalid", "b").status)
	replay := s.post("/orders", "invalid", "b")
	assert.Equal(t, http.StatusConflict, replay.status, "the 4xx is stored")
	assert.True(t, replay.replayed())
	assert.Equal(t, 1, count(t, s.pool, `SELECT count(*) FROM effects WHERE key = 'failed'`), "its write committed with it")
	assert.Equal(t, 2, s.effects())
}

// A Store policy can keep 5xx too: then the write commits and the 5xx
// replays.
func TestStorePolicyCanKeep5xx(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		_, err := idempotency.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ('x', '')`)
		assert.NoError(t, err)
		http.Error(w, "declined", http.StatusInternalServerError)
	}
	s := newService(t, idempotency.Config{Store: func(int) bool { return true }}, http.HandlerFunc(h))
	assert.Equal(t, http.StatusInternalServerError, s.post("/orders", "k", "b").status)
	r := s.post("/orders", "k", "b")
	assert.Equal(t, http.StatusInternalServerError, r.status)
	assert.True(t, r.replayed())
	assert.Equal(t, 1, s.effects())
}

// A panicking handler's transaction rolls back; the retry runs.
func TestHandlerPanicRollsBack(t *testing.T) {
	var mu sync.Mutex
	panicked := false
	h := func(w http.ResponseWriter, r *http.Request) {
		_, err := idempotency.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ('panic', '')`)
		assert.NoError(t, err)
		mu.Lock()
		first := !panicked
		panicked = true
		mu.Unlock()
		if first {
			panic(http.ErrAbortHandler) // net/http closes the connection quietly
		}
		insertEffect(w, r)
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
	s.client = noRetryClient
	_, err := s.tryPost("/orders", "k", "b")
	require.Error(t, err, "the connection is closed")
	assert.Equal(t, 0, s.effects())
	assert.Equal(t, 0, s.keys())
	assert.Equal(t, http.StatusCreated, s.post("/orders", "k", "b").status)
	assert.Equal(t, 2, s.effects()) // the retry's 'panic' row and its effect, once
}

// The handler cannot end the middleware's transaction.
func TestHandlerCannotEndTheTransaction(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		tx := idempotency.Tx(r.Context())
		assert.ErrorIs(t, tx.Commit(r.Context()), idempotency.ErrTxOwned)
		assert.ErrorIs(t, tx.Rollback(r.Context()), idempotency.ErrTxOwned)
		insertEffect(w, r)
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
	assert.Equal(t, http.StatusCreated, s.post("/orders", "k", "b").status)
	assert.True(t, s.post("/orders", "k", "b").replayed())
	assert.Equal(t, 1, s.effects())
	assert.Nil(t, idempotency.Tx(context.Background()))
	assert.Empty(t, idempotency.Key(context.Background()))
}

// A handler that ignores a failed statement and answers success gets a
// 500 instead: nothing committed, so claiming success would be a lie. A
// handler that answers the failure with a 4xx has its answer sent, not
// stored.
func TestFailedStatementIsNotCommitted(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		tx := idempotency.Tx(r.Context())
		_, _ = tx.Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ('x', '')`)
		_, err := tx.Exec(r.Context(), `INSERT INTO no_such_table VALUES (1)`)
		if r.URL.Path == "/honest" {
			http.Error(w, err.Error(), http.StatusUnprocessableEntity)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}
	s := newService(t, idempotency.Config{}, http.HandlerFunc(h))
	assert.Equal(t, http.StatusInternalServerError, s.post("/lying", "k1", "b").status)
	r := s.post("/honest", "k2", "b")
	assert.Equal(t, http.StatusUnprocessableEntity, r.status)
	assert.Contains(t, r.body, "no_such_table")
	assert.Equal(t, 0, s.effects())
	assert.Equal(t, 0, s.keys())
}

// Bodies past the limits: a request body gets 413 before anything runs; a
// response body too large to store is refused to the handler, rolled back
// and answered with 500.
func TestBodyLimits(t *testing.T) {
	var writeErr error
	h := func(w http.ResponseWriter, r *http.Request) {
		_, err := idempotency.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ('x', '')`)
		assert.NoError(t, err)
		_, writeErr = w.Write([]byte(strings.Repeat("x", 200)))
	}
	s := newService(t, idempotency.Config{MaxRequestBytes: 100, MaxResponseBytes: 150}, http.HandlerFunc(h))
	assert.Equal(t, http.StatusRequestEntityTooLarge, s.post("/orders", "k", strings.Repeat("b", 101)).status)
	assert.Equal(t, http.StatusInternalServerError, s.post("/orders", "k", "b").status)
	assert.ErrorIs(t, writeErr, idempotency.ErrResponseTooLarge)
	assert.Equal(t, 0, s.effects())
	assert.Equal(t, 0, s.keys())
}

// A database that cannot be reached is a 503 with Retry-After: the client
// retries with the same key.
func TestDatabaseUnreachableGets503(t *testing.T) {
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	unreachable := unreachablePool(t)
	down := serve(t, unreachable, s.schema, idempotency.Config{}, http.HandlerFunc(insertEffect))
	r := down.post("/orders", "k", "b")
	assert.Equal(t, http.StatusServiceUnavailable, r.status, r.body)
	assert.Equal(t, "1", r.header.Get("Retry-After"))
	assert.Equal(t, http.StatusCreated, s.post("/orders", "k", "b").status, "the retry, once the database is back")
}

// New refuses configurations that cannot work.
func TestNewRejectsBadConfiguration(t *testing.T) {
	pool := unreachablePool(t)
	for name, cfg := range map[string]idempotency.Config{
		"no scope":       {},
		"bad schema":     {Scope: idempotency.SingleScope, Schema: "a; DROP TABLE x"},
		"negative wait":  {Scope: idempotency.SingleScope, Wait: -1},
		"negative ttl":   {Scope: idempotency.SingleScope, TTL: -time.Second},
		"negative batch": {Scope: idempotency.SingleScope, RetentionBatch: -1},
		"acquire -2":     {Scope: idempotency.SingleScope, AcquireTimeout: -2},
	} {
		_, err := idempotency.New(pool, cfg)
		assert.True(t, errors.Is(err, idempotency.ErrConfig) || errors.Is(err, idempotency.ErrInvalidName), "%s: %v", name, err)
	}
	_, err := idempotency.New(pool, idempotency.Config{Scope: idempotency.SingleScope, AcquireTimeout: idempotency.NoAcquireTimeout})
	assert.NoError(t, err, "NoAcquireTimeout is a bound of its own")
	_, err = idempotency.New(nil, idempotency.Config{Scope: idempotency.SingleScope})
	assert.ErrorIs(t, err, idempotency.ErrConfig)
	// A pool whose constructor failed, its error dropped, is a nil
	// *pgxpool.Pool in a non-nil Pool: it was accepted, and every request
	// then panicked.
	var failed *pgxpool.Pool
	_, err = idempotency.New(failed, idempotency.Config{Scope: idempotency.SingleScope})
	assert.ErrorIs(t, err, idempotency.ErrConfig, "a nil *pgxpool.Pool")
	assert.ErrorIs(t, idempotency.Migrate(context.Background(), pool, "x-y"), idempotency.ErrInvalidName)
}

// The database connection breaks while the handler runs (its effect
// written, not committed): the client gets 503, the server rolls the
// transaction back, and the retry with the same key runs once.
func TestConnectionCutMidRequestGets503(t *testing.T) {
	g := newGate()
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	u, err := url.Parse(pgtest.URL())
	require.NoError(t, err)
	proxy, err := netcut.NewProxy(u.Host)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	u.Host = proxy.Addr()
	cfg, err := pgxpool.ParseConfig(u.String())
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = s.schema
	cut, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(cut.Close)
	h := func(w http.ResponseWriter, r *http.Request) {
		_, err := idempotency.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (key, body) VALUES ('cut', '')`)
		assert.NoError(t, err)
		g.entered <- struct{}{}
		<-g.open
		w.WriteHeader(http.StatusCreated)
	}
	viaProxy := serve(t, cut, s.schema, idempotency.Config{}, http.HandlerFunc(h))

	first := make(chan reply, 1)
	go func() { first <- viaProxy.post("/orders", "k", "b") }()
	g.waitEntered(t)
	require.Positive(t, proxy.Cut())
	close(g.open)
	r := <-first
	assert.Equal(t, http.StatusServiceUnavailable, r.status, r.body)
	assert.Equal(t, "1", r.header.Get("Retry-After"))

	// The retry, through a healthy pool: the server has rolled the first
	// back (or is about to: the retry waits for its lock).
	retried := serve(t, s.pool, s.schema, idempotency.Config{Wait: 30 * time.Second}, http.HandlerFunc(insertEffect))
	again := retried.post("/orders", "k", "b")
	assert.Equal(t, http.StatusCreated, again.status, again.body)
	assert.False(t, again.replayed())
	assert.Equal(t, 0, count(t, s.pool, `SELECT count(*) FROM effects WHERE key = 'cut'`))
	assert.Equal(t, 1, s.effects())
}

// Two services with tables of their own (a schema each, as two services
// sharing a server, or two tests running in parallel) do not share keys:
// a key in flight at one is not in flight at the other.
func TestSameKeyInAnotherTableIsNotInFlight(t *testing.T) {
	g := newGate()
	a := newService(t, idempotency.Config{}, g.wrap(insertEffect))
	b := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))

	first := make(chan reply, 1)
	go func() { first <- a.post("/orders", "shared-key", "a") }()
	g.waitEntered(t)
	other := b.post("/orders", "shared-key", "b")
	// The same table named through the search_path is the same table.
	unqualified := serve(t, pgtest.NewPoolWith(t, a.schema, func(*pgxpool.Config) {}), "", idempotency.Config{},
		http.HandlerFunc(insertEffect))
	same := unqualified.post("/orders", "shared-key", "a")
	close(g.open)
	assert.Equal(t, http.StatusConflict, same.status, same.body)
	assert.Equal(t, http.StatusCreated, other.status, other.body)
	assert.Equal(t, 1, b.effects())
	got := <-first
	assert.Equal(t, http.StatusCreated, got.status, got.body)
	assert.Equal(t, 1, a.effects())
}

// A read-only transaction cannot hold the claim of a key: every request
// with a key would fail (503, "retry", forever). New refuses it.
func TestNewRefusesAReadOnlyTransaction(t *testing.T) {
	_, err := idempotency.New(unreachablePool(t), idempotency.Config{Scope: idempotency.SingleScope,
		TxOptions: pgx.TxOptions{AccessMode: pgx.ReadOnly}})
	require.ErrorIs(t, err, idempotency.ErrConfig)
	assert.Contains(t, err.Error(), "TxOptions")
}

// PostgreSQL's lock_timeout, which bounds Wait, holds at most 2^31-1
// milliseconds (about 24.8 days): a longer Wait made the server refuse the
// setting, and every request with a key failed. New refuses it.
func TestNewRefusesAWaitPastLockTimeout(t *testing.T) {
	_, err := idempotency.New(unreachablePool(t), idempotency.Config{Scope: idempotency.SingleScope,
		Wait: 25 * 24 * time.Hour})
	require.ErrorIs(t, err, idempotency.ErrConfig)
	assert.Contains(t, err.Error(), "Wait")
	_, err = idempotency.New(unreachablePool(t), idempotency.Config{Scope: idempotency.SingleScope,
		Wait: math.MaxInt32 * time.Millisecond})
	require.NoError(t, err)
}

// A TTL below a millisecond is a unit mistake (TTL: 24 is 24ns, not a
// day): responses expired as they were stored, and replays silently never
// happened. New refuses it.
func TestNewRefusesATTLBelowAMillisecond(t *testing.T) {
	_, err := idempotency.New(unreachablePool(t), idempotency.Config{Scope: idempotency.SingleScope, TTL: 24})
	require.ErrorIs(t, err, idempotency.ErrConfig)
	assert.Contains(t, err.Error(), "TTL")
	_, err = idempotency.New(unreachablePool(t), idempotency.Config{Scope: idempotency.SingleScope, TTL: time.Millisecond})
	require.NoError(t, err)
}

// A Header that is no valid HTTP field name (a space, a colon, empty
// after trimming) can never arrive on a request: every request got 400 as
// if it had no key, or, with Optional, ran unprotected without a word.
// New refuses it.
func TestNewRefusesAHeaderNoRequestCanCarry(t *testing.T) {
	for _, h := range []string{"Idempotency Key", "Idempotency-Key:", " ", "Idempotency-Key\n"} {
		for _, optional := range []bool{false, true} {
			_, err := idempotency.New(unreachablePool(t), idempotency.Config{Scope: idempotency.SingleScope, Header: h, Optional: optional})
			require.ErrorIs(t, err, idempotency.ErrConfig, "%q", h)
			assert.Contains(t, err.Error(), "Header")
		}
	}
	_, err := idempotency.New(unreachablePool(t), idempotency.Config{Scope: idempotency.SingleScope, Header: "x-request-key"})
	require.NoError(t, err)
}
