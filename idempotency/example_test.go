package idempotency_test

import (
	"context"
	"encoding/json"
	"log"
	"net/http"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/idempotency"
)

// The middleware in front of a command endpoint: the handler writes in
// the request's transaction, in which the key was claimed, and the
// response is stored with the writes.
func ExampleMiddleware_Handler() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	// The same schema as processed_events: one store for both entry points.
	if err := idempotency.Migrate(ctx, pool, ""); err != nil {
		log.Fatal(err)
	}
	mw, err := idempotency.New(pool, idempotency.Config{
		// One client's keys never meet another's: scope by principal.
		Scope: func(r *http.Request) string { return r.Header.Get("X-Account") },
		// Wait for a first request still running instead of answering 409.
		Wait: 2 * time.Second,
	})
	if err != nil {
		log.Fatal(err)
	}
	go mw.RunRetention(ctx) //nolint:errcheck // deletes expired keys until ctx ends

	placeOrder := func(w http.ResponseWriter, r *http.Request) {
		var order struct{ Item string }
		if err := json.NewDecoder(r.Body).Decode(&order); err != nil {
			http.Error(w, "bad order", http.StatusBadRequest) // 4xx: stored, replayed
			return
		}
		// The key is unique within its scope only (another account may
		// send the same one): with the account, it is the order's id.
		tx := idempotency.Tx(r.Context())
		_, err := tx.Exec(r.Context(), `INSERT INTO orders (account, id, item) VALUES ($1, $2, $3)`,
			r.Header.Get("X-Account"), idempotency.Key(r.Context()), order.Item)
		if err != nil {
			http.Error(w, "try again", http.StatusServiceUnavailable) // 5xx: rolled back, not stored
			return
		}
		w.Header().Set("Location", "/orders/"+idempotency.Key(r.Context()))
		w.WriteHeader(http.StatusCreated)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw.Handler(http.HandlerFunc(placeOrder)))
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", mux))
}
