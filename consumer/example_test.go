package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
)

type OrderCreated struct {
	OrderID string `json:"order_id"`
	Amount  int64  `json:"amount"`
}

// A consumer whose handler writes its business row in the transaction the
// consumer opened: the row and the processed-event claim commit together,
// so a redelivered event finds its claim and is skipped.
func ExampleNew() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	// Any adapter: brokers/kafka, brokers/amqp, or this in-memory one.
	broker := memsource.New(memsource.Options{Streams: 4})

	handle := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[OrderCreated]) error {
		_, err := tx.Exec(ctx, `INSERT INTO orders (id, amount) VALUES ($1, $2)`, ev.Payload.OrderID, ev.Payload.Amount)
		return err
	}
	c, err := consumer.New(pool, broker.Source(), handle, consumer.Config{Name: "billing"})
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Run(ctx); err != nil { // until ctx is cancelled
		log.Fatal(err)
	}
}

// A consumer whose handler writes a whole batch with one multi-row
// statement: the events of a batch are new (their ids claimed in tx) and
// commit together with their claims. A failing batch is halved until the
// failing event is alone, so the handler must accept batches of any size.
func ExampleNewBatch() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	broker := memsource.New(memsource.Options{Streams: 4})

	handle := func(ctx context.Context, tx pgx.Tx, events []consumer.Event[OrderCreated]) error {
		ids := make([]string, len(events))
		amounts := make([]int64, len(events))
		for i, ev := range events {
			ids[i], amounts[i] = ev.Payload.OrderID, ev.Payload.Amount
		}
		_, err := tx.Exec(ctx, `INSERT INTO orders (id, amount) SELECT * FROM unnest($1::text[], $2::bigint[])`, ids, amounts)
		return err
	}
	c, err := consumer.NewBatch(pool, broker.Source(), handle, consumer.Config{Name: "billing"})
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Run(ctx); err != nil { // until ctx is cancelled
		log.Fatal(err)
	}
}

// One consumer, one typed handler per event type.
func ExampleNewRouted() {
	r := consumer.NewRouter[any](consumer.RouterConfig{UnknownTypes: consumer.SkipUnknownTypes})
	err := consumer.Handle(r, "order.created", func(ctx context.Context, tx pgx.Tx, ev consumer.Event[OrderCreated]) error {
		_, err := tx.Exec(ctx, `INSERT INTO orders (id, amount) VALUES ($1, $2)`, ev.Payload.OrderID, ev.Payload.Amount)
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	// Then: c, err := consumer.NewRouted(pool, source, r, consumer.Config{Name: "billing"})
	fmt.Println(r.Types())

	// Output: [order.created]
}

// Reading a CloudEvent in structured JSON mode: id and type come from the
// envelope, the handler gets the data.
func ExampleJSONEnvelope() {
	o, err := consumer.JSONEnvelope{}.Open([]byte(`{"specversion":"1.0","id":"evt-1","type":"order.created","data":{"order_id":"o-1","amount":250}}`))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(o.ID, o.Type, string(o.Payload))
	// Output: evt-1 order.created {"order_id":"o-1","amount":250}
}

// Handler outcomes: a permanent failure goes to the dead-letter queue at
// once; RetryAfter asks for another attempt later.
func ExamplePermanent() {
	handle := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[OrderCreated]) error {
		if ev.Payload.Amount < 0 {
			return consumer.Permanent(fmt.Errorf("order %s: negative amount", ev.Payload.OrderID))
		}
		return nil
	}
	// Called here by hand; the consumer calls it inside the transaction.
	err := handle(context.Background(), nil, consumer.Event[OrderCreated]{Payload: OrderCreated{OrderID: "o-1", Amount: -5}})
	var permanent *consumer.PermanentError
	fmt.Println(errors.As(err, &permanent), err)
	// Output: true permanent: order o-1: negative amount
}

// A handler that queues its writes instead of sending them: in a batch,
// every handler's statements reach PostgreSQL in one round trip before the
// commit. A callback checks a statement's result; its error is the
// handler's.
func ExampleEvent_Queue() {
	_ = func(ctx context.Context, tx pgx.Tx, ev consumer.Event[OrderCreated]) error {
		ev.Queue(`INSERT INTO orders (id, amount) VALUES ($1, $2)`, ev.Payload.OrderID, ev.Payload.Amount)
		ev.Queue(`UPDATE accounts SET balance = balance + $2 WHERE order_id = $1`, ev.Payload.OrderID, ev.Payload.Amount).
			Exec(func(ct pgconn.CommandTag) error {
				if ct.RowsAffected() == 0 {
					return consumer.Permanent(fmt.Errorf("order %s: no account", ev.Payload.OrderID))
				}
				return nil
			})
		return nil
	}
}

// Testing a handler against a real database: Call runs it on a hand-built
// Event in a transaction of the test's own, sending what it queued.
func ExampleCall() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	handle := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[OrderCreated]) error {
		ev.Queue(`INSERT INTO orders (id, amount) VALUES ($1, $2)`, ev.Payload.OrderID, ev.Payload.Amount)
		return nil
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // the test's changes are thrown away
	ev := consumer.Event[OrderCreated]{ID: "evt-1", Payload: OrderCreated{OrderID: "o-1", Amount: 250}}
	if err := consumer.Call(ctx, tx, handle, ev); err != nil {
		log.Fatal(err)
	}
	// The row is in tx now: check it with tx.QueryRow.
}
