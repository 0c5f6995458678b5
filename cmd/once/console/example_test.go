package console_test

import (
	"context"
	"log"
	"net/http"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
)

// A service mounts the console under /ops/, read-only, beside its own
// handlers and behind its own access control.
func ExampleNew() {
	pool, err := pgxpool.New(context.Background(), os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	orders, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: []string{"kafka-1:9092"}, Topic: "orders.dlq"})
	if err != nil {
		log.Fatal(err)
	}
	h, err := console.New(console.Config{DB: pool, Queues: []dlq.Queue{orders}})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/", http.StripPrefix("/ops", h))
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", mux))
}
