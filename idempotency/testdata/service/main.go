package main

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/onceco/once/idempotency"
)

func main() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	check(idempotency.Migrate(ctx, pool, "")) // the idempotency_keys table, next to payments
	mw, err := idempotency.New(pool, idempotency.Config{Scope: func(r *http.Request) string { u, _, _ := r.BasicAuth(); return u }})
	check(err)
	go mw.RunRetention(ctx) //nolint:errcheck // deletes expired keys until the process ends
	http.Handle("POST /payments", mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var id int64 // the effect, in the transaction that claims the key; 4xx stored, 5xx rolled back
		if err := idempotency.Tx(r.Context()).QueryRow(r.Context(),
			`INSERT INTO payments (amount) VALUES ($1) RETURNING id`, r.FormValue("amount")).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "payment %d\n", id)
	})))
	log.Fatal(http.ListenAndServe(os.Getenv("ADDR"), nil))
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
