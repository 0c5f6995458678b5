package main

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

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
