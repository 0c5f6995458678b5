package main

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

// POST /orders places one order per key, whatever the copies and retries:
// concurrent copies and a later retry get the first's order id, a reuse
// for another order gets 422, and another customer's same key is its own.
func TestPlaceOrderOncePerKey(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	ctx := context.Background()
	require.NoError(t, Migrate(ctx, pool))
	h, err := webHandler(ctx, pool, nil)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	defer srv.Close()

	post := func(customer, key, body string) (int, string) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set(idempotency.DefaultHeader, key)
		req.SetBasicAuth(customer, "x")
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		var got struct {
			OrderID string `json:"order_id"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&got)
		return resp.StatusCode, got.OrderID
	}
	ids := make([]string, 10)
	var wg sync.WaitGroup
	for i := range ids {
		wg.Go(func() {
			status, id := post("alice", "k1", `{"customer":"alice","amount_cents":500}`)
			assert.Equal(t, http.StatusCreated, status)
			ids[i] = id
		})
	}
	wg.Wait()
	for _, id := range ids {
		assert.Equal(t, ids[0], id)
	}
	status, id := post("alice", "k1", `{"customer":"alice","amount_cents":500}`)
	assert.Equal(t, http.StatusCreated, status)
	assert.Equal(t, ids[0], id)
	status, _ = post("alice", "k1", `{"customer":"alice","amount_cents":501}`)
	assert.Equal(t, http.StatusUnprocessableEntity, status)
	status, other := post("bob", "k1", `{"customer":"bob","amount_cents":500}`)
	assert.Equal(t, http.StatusCreated, status)
	assert.NotEqual(t, ids[0], other)
	status, _ = post("bob", "k2", `{"customer":""}`)
	assert.Equal(t, http.StatusBadRequest, status)

	var orders int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&orders))
	assert.Equal(t, 2, orders)
}

// The serve command with -http-addr takes orders by both entry points into
// one orders table: a Kafka order.created, and a POST /orders retried with
// its key, once each.
func TestServeTakesOrdersOverKafkaAndHTTP(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	t.Setenv("DATABASE_URL", pgtest.URL())
	t.Setenv("KAFKA_BROKERS", "")
	t.Setenv("BROKER", "")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errOut syncBuffer
	done := make(chan int, 1)
	go func() {
		done <- realMain(ctx, []string{"serve", "-schema", schema, "-name", "web-" + schema, "-metrics-addr", "off",
			"-http-addr", "127.0.0.1:0"}, &out, &errOut)
	}()
	broker := waitMatch(t, &out, regexp.MustCompile(`listening on (127\.0\.0\.1:\d+)`))[1]
	url := waitMatch(t, &out, regexp.MustCompile(`http: POST (http://\S+/orders)`))[1]
	waitMatch(t, &out, regexp.MustCompile(`consuming orders`))

	pub, err := newKafkaPublisher([]string{broker}, "orders")
	require.NoError(t, err)
	require.NoError(t, pub.Publish(ctx, []outMsg{{Key: "o-1", ID: "evt-1", Type: TypeCreated,
		Value: []byte(`{"order_id":"o-1","customer":"kim","amount_cents":700}`)}}))
	require.NoError(t, pub.Close())

	var ids []string
	for range 2 {
		req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"customer":"lee","amount_cents":900}`))
		require.NoError(t, err)
		req.Header.Set(idempotency.DefaultHeader, "lee-1")
		req.SetBasicAuth("lee", "x")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		var got struct {
			OrderID string `json:"order_id"`
		}
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&got))
		_ = resp.Body.Close()
		require.Equal(t, http.StatusCreated, resp.StatusCode)
		ids = append(ids, got.OrderID)
	}
	assert.Equal(t, ids[0], ids[1], "the retry got the first order")
	require.Eventually(t, func() bool {
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM orders WHERE id IN ('o-1', $1)`, ids[0]).Scan(&n)
		return n == 2
	}, 60*time.Second, 20*time.Millisecond, "both orders are in the table")
	var total int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&total))
	assert.Equal(t, 2, total)

	cancel()
	select {
	case c := <-done:
		require.Equal(t, 0, c, "stderr:\n%s", errOut.String())
	case <-time.After(30 * time.Second):
		t.Fatal("serve did not stop within 30s of its context being cancelled")
	}
}

// The demo's HTTP check fails unless every answer is the one its request
// must get: here a server that creates one order per key, as it must, but
// answers a key reused for another order with the first order (201)
// instead of 422, and never answers some retries but with 503.
func TestWebRunFailsOnWrongAnswers(t *testing.T) {
	for _, tc := range []struct {
		name  string
		serve func(w http.ResponseWriter, first bool, order string)
	}{
		{"a reuse answered with the first order", func(w http.ResponseWriter, first bool, order string) {
			w.Header().Set(idempotency.ReplayedHeader, strconv.FormatBool(!first))
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(`{"order_id":"` + order + `"}`))
		}},
		{"a retry never answered", func(w http.ResponseWriter, first bool, order string) {
			if !first {
				http.Error(w, "unavailable", http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(`{"order_id":"` + order + `"}`))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			orders := map[string]string{} // key -> order id
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				key := r.Header.Get(idempotency.DefaultHeader)
				order, seen := orders[key]
				if !seen {
					order = "web-" + key
					orders[key] = order
				}
				mu.Unlock()
				tc.serve(w, !seen, order)
			}))
			defer srv.Close()
			keys := webTraffic(7, 50)
			reuses, retries := 0, 0
			for _, k := range keys {
				reuses += map[bool]int{true: 1}[k.reuse]
				retries += map[bool]int{true: 1}[k.retry]
			}
			require.NotZero(t, reuses, "the traffic reuses a key")
			require.NotZero(t, retries, "the traffic retries a key")
			run := sendWebTraffic(context.Background(), srv.URL, keys)
			// The database is right: one order and one key row per key.
			run.orderRows, run.keyRows = len(orders), len(orders)
			require.Equal(t, len(keys), run.created, "one order created per key")
			require.Zero(t, run.splitKeys)
			assert.False(t, run.ok(), "%+v", *run)
		})
	}
}
