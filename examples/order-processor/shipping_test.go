package main

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
)

// The second hop's count passes only when each paid order has exactly one
// outbox row under its payment's id + "/confirmed", published, and exactly
// one shipment under that id: a doubled shipment, a shipment under another
// id, a missing or pending row, a shipment of an unpaid order, or the
// shipping consumer's processed_events row under another id fails it.
func TestHop2CountCatchesEveryWrongEffect(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	require.NoError(t, resetDemoTables(ctx, pool))
	o := &options{broker: "kafka", topic: "orders", name: "order-processor", schema: schema}
	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}
	// Two paid orders, each confirmed (published) and shipped once; a
	// created order with nothing.
	for _, id := range []string{"o-1", "o-2"} {
		exec(`INSERT INTO orders (id, customer, amount_cents, status, created_event) VALUES ($1, 'c', 100, 'paid', $1 || '/created')`, id)
		exec(`INSERT INTO payments (order_id, payment_id, event_id, amount_cents) VALUES ($1, 'p', 'evt-' || $1, 100)`, id)
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return outbox.Add(ctx, tx, outbox.Message{ID: "evt-" + id + "/confirmed", Topic: confirmedName(o), Key: []byte(id),
				Type: TypeConfirmed, Body: []byte(`{}`)})
		}))
		exec(`INSERT INTO shipments (order_id, event_id) VALUES ($1, 'evt-' || $1 || '/confirmed')`, id)
		exec(`INSERT INTO processed_events (consumer, event_id) VALUES ($1, 'evt-' || $2 || '/confirmed')`, shippingName(o), id)
	}
	exec(`INSERT INTO orders (id, customer, amount_cents, status, created_event) VALUES ('o-3', 'c', 100, 'created', 'o-3/created')`)
	check := func() hopCounts {
		t.Helper()
		c, err := countHop2(ctx, pool, o)
		require.NoError(t, err)
		return c
	}
	require.False(t, check().ok(), "rows not yet published")
	exec(`UPDATE outbox SET sent_at = now()`)
	c := check()
	require.True(t, c.ok(), "%+v", c)
	require.EqualValues(t, 2, c.PaidOrders)

	breakages := []struct {
		name, do, undo string
	}{
		{"a doubled shipment", `INSERT INTO shipments (order_id, event_id) VALUES ('o-1', 'evt-o-1/confirmed')`,
			`DELETE FROM shipments WHERE ctid = (SELECT max(ctid) FROM shipments WHERE order_id = 'o-1')`},
		{"a shipment under another id", `UPDATE shipments SET event_id = 'other' WHERE order_id = 'o-2'`,
			`UPDATE shipments SET event_id = 'evt-o-2/confirmed' WHERE order_id = 'o-2'`},
		{"a shipment of an unpaid order", `INSERT INTO shipments (order_id, event_id) VALUES ('o-3', 'x')`,
			`DELETE FROM shipments WHERE order_id = 'o-3'`},
		{"a pending row", `UPDATE outbox SET sent_at = NULL WHERE key = 'o-1'`, `UPDATE outbox SET sent_at = now()`},
		{"a row under another id", `UPDATE outbox SET event_id = 'x' WHERE key = 'o-2'`,
			`UPDATE outbox SET event_id = 'evt-o-2/confirmed' WHERE key = 'o-2'`},
		{"a shipping claim under another id", `UPDATE processed_events SET event_id = 'other' WHERE event_id = 'evt-o-2/confirmed'`,
			`UPDATE processed_events SET event_id = 'evt-o-2/confirmed' WHERE event_id = 'other'`},
		{"a missing row", `DELETE FROM outbox WHERE key = 'o-1'`, ``},
	}
	for _, b := range breakages {
		exec(b.do)
		require.False(t, check().ok(), b.name)
		if b.undo != "" {
			exec(b.undo)
			require.True(t, check().ok(), "after undoing %s", b.name)
		}
	}
}

// Paid emits order.confirmed through the outbox in the payment's
// transaction, under the payment's id + "/confirmed": a rolled-back
// payment leaves no row.
func TestPaidEmitsConfirmationInItsTransaction(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	require.NoError(t, resetDemoTables(ctx, pool))
	_, err := pool.Exec(ctx, `INSERT INTO orders (id, customer, amount_cents, status, created_event) VALUES ('o-1', 'c', 250, 'created', 'e')`)
	require.NoError(t, err)
	dest := &confirmedDest{Topic: "orders.confirmed"}
	msg, err := dest.confirmation(consumer.Event[OrderPaid]{ID: "evt-7", Payload: OrderPaid{OrderID: "o-1", PaymentID: "p", AmountCents: 250}})
	require.NoError(t, err)
	require.Equal(t, "evt-7/confirmed", msg.ID)
	require.Equal(t, []byte("o-1"), msg.Key)
	require.Equal(t, TypeConfirmed, msg.Type)
	require.JSONEq(t, `{"order_id":"o-1","amount_cents":250}`, string(msg.Body))

	sql, args, err := outboxStore.Statement(ctx, msg)
	require.NoError(t, err)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, sql, args...)
	require.NoError(t, err)
	var n int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n))
	require.Equal(t, 1, n, "the statement writes the confirmation into the outbox in the payment's transaction")
	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n))
	require.Zero(t, n, "a rolled-back payment emits nothing")
}

// The second hop stops as a whole: when the shipping consumer ends by
// itself (here its dedup table is at a version newer than this code
// knows), the relay stops too and Run returns the error, rather than
// relay on with nobody shipping.
func TestDownstreamStopsWhenTheShippingConsumerFails(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	require.NoError(t, resetDemoTables(ctx, pool))
	_, err := pool.Exec(ctx, `INSERT INTO once_schema_versions (component, version, name) VALUES ('dedup:shipping_events', 99, 'future')`)
	require.NoError(t, err)
	k, err := startEmbeddedKafka(0, "orders", 1)
	require.NoError(t, err)
	defer k.Close()
	o := &options{broker: "kafka", kafkaBrokers: k.addrs, topic: "orders", name: "down-" + schema}

	store, err := dedup.New(dedup.Config{Table: "shipping_events"})
	require.NoError(t, err)
	b := memsource.New(memsource.Options{})
	ship, err := consumer.New(pool, b.Source(), Ship, consumer.Config{Name: shippingName(o), Store: store})
	require.NoError(t, err)
	d := &downstream{shipping: ship}
	require.NoError(t, d.openPublisher(o))
	d.relay, err = outbox.NewRelay(pool, d.pub, outbox.RelayConfig{PollInterval: 50 * time.Millisecond})
	require.NoError(t, err)

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- d.Run(runCtx) }()
	select {
	case err := <-done:
		require.ErrorContains(t, err, "schema is newer than this code")
	case <-time.After(30 * time.Second):
		cancel()
		t.Fatalf("the relay ran on 30s after the shipping consumer failed (Run after cancel: %v)", <-done)
	}
}
