package kafka_test

import (
	"context"
	"log"
	"os"
	"os/signal"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
)

type OrderPlaced struct {
	OrderID string `json:"order_id"`
	Amount  int64  `json:"amount_cents"`
}

// A service consuming the "orders" topic as group "billing" and writing one
// invoice per order, exactly once. It needs a Kafka broker and PostgreSQL.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	base := sarama.NewConfig()
	base.ClientID = "billing"
	// TLS and SASL go here: base.Net.TLS.Enable, base.Net.SASL.Mechanism...
	src, err := kafka.Open(ctx, kafka.Config{
		Brokers:        []string{"localhost:9092"},
		Group:          "billing",
		Topics:         []string{"orders"},
		CommitInterval: time.Second,
		Sarama:         base,
		// Poison records go to "orders.dlq", which must exist.
	})
	if err != nil {
		log.Fatal(err)
	}

	c, err := consumer.New(pool, src, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[OrderPlaced]) error {
		_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id, amount_cents) VALUES ($1, $2)`,
			ev.Payload.OrderID, ev.Payload.Amount)
		return err
	}, consumer.Config{Name: "billing"})
	if err != nil {
		log.Fatal(err)
	}
	// Run closes the source when ctx is cancelled, committing the offsets
	// of every record whose transaction committed.
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
