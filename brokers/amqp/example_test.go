package amqp_test

import (
	"context"
	"log"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// OrderPlaced is the payload of the example's events.
type OrderPlaced struct {
	OrderID string `json:"order_id"`
	Total   int64  `json:"total_cents"`
}

// A service consuming the "orders" queue, which is bound to the "shop"
// topic exchange. Each order row is written exactly once, whatever the
// broker redelivers; poison messages go to "orders.dlq". Publishers set
// the message-id property (the event id) and the type property.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	src, err := amqp.Open(ctx, amqp.Config{
		URL:       os.Getenv("AMQP_URL"), // amqps://... for TLS, with Config.TLSConfig if needed
		Queue:     "orders",
		QueueType: amqp.QueueQuorum,
		Exchanges: []amqp.Exchange{{Name: "shop", Kind: "topic"}},
		Bindings:  []amqp.Binding{{Exchange: "shop", RoutingKey: "order.placed"}},
		Prefetch:  64, // a few times consumer.Config.Concurrency
	})
	if err != nil {
		log.Fatal(err)
	}

	c, err := consumer.New(pool, src, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[OrderPlaced]) error {
		_, err := tx.Exec(ctx, `INSERT INTO orders (id, total_cents) VALUES ($1, $2)`, ev.Payload.OrderID, ev.Payload.Total)
		return err
	}, consumer.Config{Name: "orders-svc", Concurrency: 16})
	if err != nil {
		log.Fatal(err)
	}
	// Run returns nil once ctx is cancelled and in-flight messages are
	// settled; it closes the source.
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
