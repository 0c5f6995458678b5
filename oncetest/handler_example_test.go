package oncetest_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/oncetest"
)

type Payment struct {
	OrderID string `json:"order_id"`
	Amount  int    `json:"amount"`
}

func handlePayment(ctx context.Context, tx pgx.Tx, ev consumer.Event[Payment]) error {
	_, err := tx.Exec(ctx, `INSERT INTO payments (order_id, amount) VALUES ($1, $2)`,
		ev.Payload.OrderID, ev.Payload.Amount)
	return err
}

func TestPaymentIsRecordedOnce(t *testing.T) {
	pool := oncetest.Postgres(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE payments (order_id text, amount int)`)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{})
	for _, id := range []string{"o1", "o1", "o2"} { // o1 is delivered twice
		b.Publish(consumer.Message{ID: "pay-" + id, Value: []byte(`{"order_id":"` + id + `","amount":5}`)})
	}
	c, err := consumer.New(pool, b.Source(), handlePayment, consumer.Config{Name: "billing"})
	require.NoError(t, err)
	stats := oncetest.Drain(t, c, b)
	require.Equal(t, uint64(1), stats.Duplicates)
	oncetest.RequireEachOnce(t, pool, `SELECT order_id FROM payments`, "o1", "o2")
}
