package idempotency_test

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

// A scope of any length or content (a client certificate's subject, a long
// token claim, bytes that are not UTF-8) holds keys like any other: the
// claim, the replay and the separation from other scopes work, where the
// scope's text once went into the table's primary key as it was and every
// request of a scope beyond PostgreSQL's index row limit got 500.
func TestAnyScopeHoldsKeys(t *testing.T) {
	random := make([]byte, 4000)
	_, err := rand.Read(random)
	require.NoError(t, err)
	long := hex.EncodeToString(random) // 8000 bytes that do not compress
	sum := sha256.Sum256([]byte(long))
	scopes := map[string]string{
		"long":      long,
		"long too":  long[:len(long)-1] + "x",
		"not utf-8": "caf\xe9",
		"nul":       "a\x00b",
		"edge":      long[:2048],
		// What a long scope is stored as, sent as a scope: another client.
		"posing": "once:sha256:" + hex.EncodeToString(sum[:]),
	}
	scope := func(r *http.Request) string { return scopes[r.Header.Get("X-Client")] }
	s := newService(t, idempotency.Config{Scope: scope}, http.HandlerFunc(insertEffect))
	bodies := map[string]string{}
	for client := range scopes {
		r := s.post("/orders", "k", "b", "X-Client", client)
		assert.Equal(t, http.StatusCreated, r.status, "%s: %s", client, r.body)
		bodies[client] = r.body
	}
	for client := range scopes {
		r := s.post("/orders", "k", "b", "X-Client", client)
		assert.True(t, r.replayed(), client)
		assert.Equal(t, bodies[client], r.body, client)
	}
	assert.Equal(t, len(scopes), s.effects())

	// The longest scope stored as it is, with the longest key.
	longKey := strings.Repeat("k", idempotency.MaxKeyLength)
	r := s.post("/orders", longKey, "b", "X-Client", "edge")
	require.Equal(t, http.StatusCreated, r.status, r.body)
	assert.True(t, s.post("/orders", longKey, "b", "X-Client", "edge").replayed())
	assert.Equal(t, 1, count(t, s.pool, `SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND idempotency_key = $2`,
		long[:2048], longKey), "stored as it is")
}

// Services that keep their keys in one idempotency_keys table (one schema,
// as they may share processed_events under their consumer names) shared
// their keys: a client that sent one key to two services (an order's id
// as the key of both its creation and its payment) got, from the second,
// the first's response replayed (422 with the default fingerprint, which
// holds the path), and the payment never ran. Config.Service keeps each
// service's keys apart; a scope of an unnamed service cannot pose as a
// named one's.
func TestServicesSharingATableKeepTheirKeysApart(t *testing.T) {
	scope := func(r *http.Request) string { return r.Header.Get("X-Client") }
	noFingerprint := func(*http.Request, []byte) []byte { return nil }
	orders := newService(t, idempotency.Config{Service: "orders", Scope: scope, Fingerprint: noFingerprint},
		http.HandlerFunc(insertEffect))
	onTheTable := func(service string) *service {
		pool := pgtest.NewPoolWith(t, orders.schema, func(*pgxpool.Config) {})
		s := serve(t, pool, orders.schema, idempotency.Config{Service: service, Scope: scope, Fingerprint: noFingerprint},
			http.HandlerFunc(insertEffect))
		return s
	}
	payments, unnamed := onTheTable("payments"), onTheTable("")

	order := orders.post("/orders", "order-1", "a", "X-Client", "alice")
	payment := payments.post("/payments", "order-1", "b", "X-Client", "alice")
	posing := unnamed.post("/orders", "order-1", "c", "X-Client", "once:service:6:orders:alice")
	for name, r := range map[string]reply{"order": order, "payment": payment, "posing": posing} {
		assert.Equal(t, http.StatusCreated, r.status, "%s: %s", name, r.body)
		assert.False(t, r.replayed(), "%s got another service's response: %s", name, r.body)
	}
	assert.Equal(t, 3, orders.effects(), "each service's handler ran")

	// Each service replays its own response.
	assert.Equal(t, order.body, orders.post("/orders", "order-1", "a", "X-Client", "alice").body)
	assert.Equal(t, payment.body, payments.post("/payments", "order-1", "b", "X-Client", "alice").body)
	assert.Equal(t, posing.body, unnamed.post("/orders", "order-1", "c", "X-Client", "once:service:6:orders:alice").body)
	assert.Equal(t, 3, orders.effects())

	// A scope too long to be stored as it is (hashed with the service) too.
	long := strings.Repeat("x", 3000)
	order = orders.post("/orders", "order-2", "a", "X-Client", long)
	payment = payments.post("/payments", "order-2", "b", "X-Client", long)
	assert.Equal(t, http.StatusCreated, order.status, order.body)
	assert.Equal(t, http.StatusCreated, payment.status, payment.body)
	assert.False(t, payment.replayed(), payment.body)
	assert.True(t, orders.post("/orders", "order-2", "a", "X-Client", long).replayed())
	assert.True(t, payments.post("/payments", "order-2", "b", "X-Client", long).replayed())
	assert.Equal(t, 5, orders.effects())
}
