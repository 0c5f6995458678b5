package outbox_test

import (
	"context"
	"encoding/json"
	"log"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/kafkaout"
)

type OrderPaid struct {
	OrderID string `json:"order_id"`
	Amount  int64  `json:"amount"`
}

// A consumer that confirms paid orders and emits order.confirmed through
// the outbox, with the relay running beside it in the same process. The
// outbox row commits with the order's update and the claim of the incoming
// event, so the confirmation is published if and only if the order was
// confirmed, and exactly once as far as the next hop can tell.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	handle := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[OrderPaid]) error {
		if _, err := tx.Exec(ctx, `UPDATE orders SET status = 'confirmed' WHERE id = $1`, ev.Payload.OrderID); err != nil {
			return err
		}
		body, err := json.Marshal(map[string]any{"order_id": ev.Payload.OrderID})
		if err != nil {
			return consumer.Permanent(err)
		}
		return outbox.Add(ctx, tx, outbox.Message{
			ID:    ev.ID + "/confirmed", // one id per incoming event, whatever happens
			Topic: "order.confirmed",
			Key:   []byte(ev.Payload.OrderID), // one order's events in order
			Type:  "order.confirmed",
			Body:  body,
		})
	}
	src, err := kafka.Open(ctx, kafka.Config{Brokers: []string{"localhost:9092"}, Group: "orders", Topics: []string{"order.paid"}})
	if err != nil {
		log.Fatal(err)
	}
	c, err := consumer.New(pool, src, handle, consumer.Config{Name: "orders"})
	if err != nil {
		log.Fatal(err)
	}

	pub, err := kafkaout.New(kafkaout.Config{Brokers: []string{"localhost:9092"}})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	relay, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{}) // migrates the "outbox" table on start
	if err != nil {
		log.Fatal(err)
	}
	go func() {
		if err := relay.Run(ctx); err != nil {
			log.Fatal(err)
		}
	}()
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
}

// Parked rows are the broker's refusals that outlived the retries: list
// them, fix the cause, requeue them (or discard them).
func ExampleStore_Parked() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, err := outbox.New(outbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	parked, err := store.Parked(ctx, pool, 100)
	if err != nil {
		log.Fatal(err)
	}
	for _, p := range parked {
		log.Printf("row %d (event %s, topic %q): %s", p.Seq, p.EventID, p.Topic, p.LastError)
		// After creating the topic:
		if _, err := store.Requeue(ctx, pool, p.Seq); err != nil {
			log.Fatal(err)
		}
	}
}
