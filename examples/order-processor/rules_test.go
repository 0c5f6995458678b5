package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// inTx runs fn in a transaction of pool, commits when it returns nil and
// rolls back otherwise, as the consumer does around a handler.
func inTx(t *testing.T, pool *pgxpool.Pool, fn func(ctx context.Context, tx pgx.Tx) error) error {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	if err := fn(ctx, tx); err != nil {
		require.NoError(t, tx.Rollback(ctx))
		return err
	}
	require.NoError(t, tx.Commit(ctx))
	return nil
}

func ev[T any](id string, p T) consumer.Event[T] {
	return consumer.Event[T]{ID: id, Payload: p, Attempt: 1}
}

// requirePermanent checks that err dead-letters at once and wraps target.
func requirePermanent(t *testing.T, err, target error) {
	t.Helper()
	var perm *consumer.PermanentError
	require.ErrorAs(t, err, &perm)
	require.ErrorIs(t, err, target)
}

// orderState returns the order's status and its payments' count and sum.
func orderState(t *testing.T, pool *pgxpool.Pool, id string) (status string, payments int, sum int64) {
	t.Helper()
	err := pool.QueryRow(context.Background(), `SELECT o.status, count(p.order_id), coalesce(sum(p.amount_cents), 0)
		FROM orders o LEFT JOIN payments p ON p.order_id = o.id WHERE o.id = $1 GROUP BY o.status`, id).Scan(&status, &payments, &sum)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", 0, 0
	}
	require.NoError(t, err)
	return status, payments, sum
}

// The handlers' business rules, each against real PostgreSQL in a
// transaction like the consumer's.
func TestHandlerRules(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	require.NoError(t, Migrate(context.Background(), pool))
	o := &Orders{UnknownOrderWait: 75 * time.Millisecond}
	created := func(id string, amount int64) error {
		return inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
			return consumer.Call(ctx, tx, o.Created, ev("c-"+id, OrderCreated{OrderID: id, Customer: "alice", AmountCents: amount}))
		})
	}
	paid := func(evID, id, payment string, amount int64) error {
		return inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
			return consumer.Call(ctx, tx, o.Paid, ev(evID, OrderPaid{OrderID: id, PaymentID: payment, AmountCents: amount}))
		})
	}
	cancelled := func(evID, id string) error {
		return inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
			return consumer.Call(ctx, tx, o.Cancelled, ev(evID, OrderCancelled{OrderID: id, Reason: "test"}))
		})
	}

	t.Run("paid before created asks for a retry", func(t *testing.T) {
		err := paid("p-1", "o-early", "pay-1", 100)
		var ra *consumer.RetryAfterError
		require.ErrorAs(t, err, &ra)
		require.Equal(t, 75*time.Millisecond, ra.Delay)
		require.ErrorIs(t, err, ErrUnknownOrder)
		status, n, _ := orderState(t, pool, "o-early")
		require.Empty(t, status)
		require.Zero(t, n)
		// Once the order exists, the same payment goes through.
		require.NoError(t, created("o-early", 100))
		require.NoError(t, paid("p-1", "o-early", "pay-1", 100))
		status, n, sum := orderState(t, pool, "o-early")
		require.Equal(t, "paid", status)
		require.Equal(t, 1, n)
		require.EqualValues(t, 100, sum)
	})

	t.Run("paid twice keeps one ledger row", func(t *testing.T) {
		require.NoError(t, created("o-twice", 250))
		require.NoError(t, paid("p-a", "o-twice", "pay-a", 250))
		requirePermanent(t, paid("p-b", "o-twice", "pay-b", 250), ErrAlreadyPaid)
		status, n, sum := orderState(t, pool, "o-twice")
		require.Equal(t, "paid", status)
		require.Equal(t, 1, n)
		require.EqualValues(t, 250, sum)
	})

	t.Run("a payment must match the order amount", func(t *testing.T) {
		require.NoError(t, created("o-amount", 300))
		requirePermanent(t, paid("p-c", "o-amount", "pay-c", 299), ErrWrongAmount)
		status, n, _ := orderState(t, pool, "o-amount")
		require.Equal(t, "created", status)
		require.Zero(t, n)
	})

	t.Run("a paid order cannot be cancelled", func(t *testing.T) {
		require.NoError(t, created("o-paid", 400))
		require.NoError(t, paid("p-d", "o-paid", "pay-d", 400))
		requirePermanent(t, cancelled("x-d", "o-paid"), ErrCancelAfterPaid)
		status, n, _ := orderState(t, pool, "o-paid")
		require.Equal(t, "paid", status)
		require.Equal(t, 1, n)
	})

	t.Run("a cancelled order takes no payment and no second cancellation", func(t *testing.T) {
		require.NoError(t, created("o-cancel", 500))
		require.NoError(t, cancelled("x-e", "o-cancel"))
		requirePermanent(t, paid("p-e", "o-cancel", "pay-e", 500), ErrCancelled)
		requirePermanent(t, cancelled("x-f", "o-cancel"), ErrCancelled)
		status, n, _ := orderState(t, pool, "o-cancel")
		require.Equal(t, "cancelled", status)
		require.Zero(t, n)
	})

	t.Run("cancelling an unknown order asks for a retry", func(t *testing.T) {
		var ra *consumer.RetryAfterError
		require.ErrorAs(t, cancelled("x-g", "o-nowhere"), &ra)
	})

	t.Run("an order is created once", func(t *testing.T) {
		require.NoError(t, created("o-once", 600))
		err := inTx(t, pool, func(ctx context.Context, tx pgx.Tx) error {
			return consumer.Call(ctx, tx, o.Created, ev("c-other", OrderCreated{OrderID: "o-once", Customer: "bob", AmountCents: 700}))
		})
		requirePermanent(t, err, ErrOrderExists)
		status, _, _ := orderState(t, pool, "o-once")
		require.Equal(t, "created", status)
	})

	t.Run("invalid events are dead-lettered", func(t *testing.T) {
		requirePermanent(t, created("o-zero", 0), ErrInvalidEvent)
		requirePermanent(t, paid("p-h", "", "pay-h", 10), ErrInvalidEvent)
		requirePermanent(t, cancelled("x-h", ""), ErrInvalidEvent)
	})
}

func TestEventID(t *testing.T) {
	cases := []struct {
		name string
		m    consumer.Message
		want string
	}{
		{"broker id first", consumer.Message{ID: "amqp-1", Headers: map[string]string{"id": "h-1"}}, "amqp-1"},
		{"id header", consumer.Message{Headers: map[string]string{"id": "h-1", "type": TypePaid}, Value: []byte(`{"order_id":"o-1"}`), FallbackID: "orders/0/7"}, "h-1"},
		{"derived from the payload", consumer.Message{Headers: map[string]string{"type": TypePaid}, Value: []byte(`{"order_id":"o-1"}`), FallbackID: "orders/0/7"}, "o-1/" + TypePaid},
		{"derived with the broker type", consumer.Message{Type: TypeCancelled, Value: []byte(`{"order_id":"o-2"}`)}, "o-2/" + TypeCancelled},
		{"malformed: the broker fallback", consumer.Message{Headers: map[string]string{"type": TypePaid}, Value: []byte(`{"order_`), FallbackID: "orders/0/9"}, "orders/0/9"},
		{"no type: the broker fallback", consumer.Message{Value: []byte(`{"order_id":"o-1"}`), FallbackID: "orders/1/3"}, "orders/1/3"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			id, err := EventID(&c.m)
			require.NoError(t, err)
			require.Equal(t, c.want, id)
		})
	}
	_, err := EventID(&consumer.Message{Value: []byte("not json")})
	require.Error(t, err)
}

// The rules' outcomes through the whole service: embedded Kafka, the
// consumer, the router and PostgreSQL.
func TestRuleOutcomesThroughTheConsumer(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	require.NoError(t, Migrate(context.Background(), pool))
	k, err := startEmbeddedKafka(0, "orders", 2)
	require.NoError(t, err)
	t.Cleanup(k.Close)
	o := &options{broker: "kafka", kafkaBrokers: k.addrs, topic: "orders", name: "rules-" + schema,
		fastFailover: true, unknownOrderWait: 30 * time.Millisecond, maxAttempts: 3}
	tel, err := startTelemetry("", "")
	require.NoError(t, err)
	t.Cleanup(func() { _ = tel.Close() })
	log := slog.New(slog.NewTextHandler(io.Discard, nil))

	created := func(id string) []byte { return mustJSON(t, OrderCreated{OrderID: id, Customer: "c", AmountCents: 900}) }
	paid := func(id, payment string) []byte {
		return mustJSON(t, OrderPaid{OrderID: id, PaymentID: payment, AmountCents: 900})
	}
	msgs := []outMsg{
		{Key: "o-late", ID: "e1", Type: TypePaid, Value: paid("o-late", "pay-1")}, // before its order
		{Key: "o-late", ID: "e2", Type: TypeCreated, Value: created("o-late")},
		{Key: "o-2", ID: "e3", Type: TypeCreated, Value: created("o-2")},
		{Key: "o-2", ID: "e4", Type: TypePaid, Value: paid("o-2", "pay-2")},
		{Key: "o-2", ID: "e4", Type: TypePaid, Value: paid("o-2", "pay-2")},  // exact duplicate
		{Key: "o-2", ID: "e5", Type: TypePaid, Value: paid("o-2", "pay-2b")}, // second payment
		{Key: "o-2", ID: "e6", Type: TypeCancelled, Value: mustJSON(t, OrderCancelled{OrderID: "o-2"})},
		{Key: "o-3", Type: TypeCreated, Value: created("o-3")}, // no id
		{Key: "o-3", Type: TypeCreated, Value: created("o-3")}, // no id, republished
	}
	pub, err := newKafkaPublisher(k.addrs, "orders")
	require.NoError(t, err)
	require.NoError(t, pub.Publish(context.Background(), msgs))
	require.NoError(t, pub.Close())

	src, err := kafkaSource(t.Context(), o, tel.MeterProvider(), log)
	require.NoError(t, err)
	c, err := newConsumer(pool, src, o, tel, log)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx) }()
	require.Eventually(t, func() bool {
		s := c.Stats()
		return s.Received == uint64(len(msgs)) && settled(s)
	}, 60*time.Second, 10*time.Millisecond)
	cancel()
	require.NoError(t, <-errc)

	s := c.Stats()
	require.EqualValues(t, 4, s.Handled)      // e2, e3, e4, o-3
	require.EqualValues(t, 2, s.Duplicates)   // e4 again, o-3 again
	require.EqualValues(t, 3, s.DeadLettered) // e1, e5, e6

	dlq, err := readKafkaTopic(k.addrs, "orders.dlq")
	require.NoError(t, err)
	byID := map[string]map[string]string{}
	for _, d := range dlq {
		byID[d.Headers[consumer.HeaderEventID]] = d.Headers
	}
	require.Len(t, byID, 3)
	require.Equal(t, "handler", byID["e1"][consumer.HeaderErrorKind])
	require.Equal(t, "3", byID["e1"][consumer.HeaderAttempts], "retried up to MaxAttempts, then dead-lettered")
	require.Contains(t, byID["e1"][consumer.HeaderErrorMessage], ErrUnknownOrder.Error())
	require.Equal(t, "1", byID["e5"][consumer.HeaderAttempts], "a rule violation is permanent: no retry")
	require.Contains(t, byID["e5"][consumer.HeaderErrorMessage], ErrAlreadyPaid.Error())
	require.Contains(t, byID["e6"][consumer.HeaderErrorMessage], ErrCancelAfterPaid.Error())

	status, n, _ := orderState(t, pool, "o-late")
	require.Equal(t, "created", status)
	require.Zero(t, n)
	status, n, sum := orderState(t, pool, "o-2")
	require.Equal(t, "paid", status)
	require.Equal(t, 1, n)
	require.EqualValues(t, 900, sum)
	var o3 int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM orders WHERE id = 'o-3'`).Scan(&o3))
	require.Equal(t, 1, o3)
	var ids []string
	rows, err := pool.Query(context.Background(), `SELECT event_id FROM processed_events WHERE consumer = $1 ORDER BY event_id`, o.name)
	require.NoError(t, err)
	ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"e2", "e3", "e4", "o-3/" + TypeCreated}, ids)
}

// The verdict is not a formality: a doubled payment, a missing order or a
// missing dead letter makes report fail.
func TestReportDetectsWrongState(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	ctx := context.Background()
	require.NoError(t, resetDemoTables(ctx, pool))
	o := &options{broker: "kafka", topic: "orders", name: "report-" + schema}
	_, err := pool.Exec(ctx, `INSERT INTO orders (id, customer, amount_cents, status, created_event) VALUES ('o-1', 'c', 100, 'paid', 'e1');
		INSERT INTO payments (order_id, payment_id, event_id, amount_cents) VALUES ('o-1', 'p', 'e2', 100)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO processed_events (consumer, event_id) VALUES ($1, 'e1'), ($1, 'e2')`, o.name)
	require.NoError(t, err)
	plan := func() *Plan {
		return &Plan{Sent: map[string]int{kindEvent: 2}, Orders: map[string]expectedOrder{"o-1": {Status: "paid", AmountCents: 100, Paid: true}},
			LedgerRows: 1, LedgerSum: 100, Messages: make([]outMsg, 2)}
	}
	run := func(p *Plan, dlq []deadLetter) (string, error) {
		var out bytes.Buffer
		err := report(ctx, &out, pool, o, p, runs{}, dlq, time.Second)
		return out.String(), err
	}
	dead := func(id, kind string) deadLetter {
		return deadLetter{Headers: map[string]string{consumer.HeaderEventID: id, consumer.HeaderErrorKind: kind}}
	}

	out, err := run(plan(), nil)
	require.NoError(t, err, out)
	require.Contains(t, out, "verdict: PASS")

	p := plan()
	p.Malformed = 1
	out, err = run(p, nil)
	require.Error(t, err, "a dead letter is missing")
	require.Contains(t, out, "verdict: FAIL")
	out, err = run(p, []deadLetter{dead("m1", "decode"), dead("m1", "decode")})
	require.NoError(t, err, "dead letters are counted by distinct event id: %s", out)
	waited := dead("e2", "handler")
	waited.Headers[consumer.HeaderErrorMessage] = "retry after 250ms: " + ErrUnknownOrder.Error() + ": o-1"
	out, err = run(p, []deadLetter{dead("m1", "decode"), waited})
	require.NoError(t, err, "a dead letter handled since (replayed) is not counted: %s", out)
	require.Contains(t, out, "replayed             1")
	crashed := dead("e2", string(consumer.KindCrashLoop))
	out, err = run(p, []deadLetter{dead("m1", "decode"), crashed})
	require.NoError(t, err, "a crash-loop dead letter handled since (replayed) is not counted: %s", out)
	// A payment dead-lettered as already paid although it is the payment
	// that was handled: the handler ran for it a second time, a copy the
	// claim should have skipped. The rule kept the ledger right; the
	// verdict must still fail.
	again := dead("e2", "handler")
	again.Headers[consumer.HeaderErrorMessage] = ErrAlreadyPaid.Error() + ": o-1 (payment p)"
	out, err = run(p, []deadLetter{dead("m1", "decode"), again})
	require.Error(t, err, "a handled event dead-lettered by its own rule: %s", out)
	require.Contains(t, out, "verdict: FAIL")
	_, err = run(p, []deadLetter{dead("m1", "decode"), dead("v1", "handler")})
	require.Error(t, err, "an unexpected dead letter")

	p = plan()
	p.Orders["o-2"] = expectedOrder{Status: "created", AmountCents: 5}
	out, err = run(p, nil)
	require.Error(t, err)
	require.Contains(t, out, "mismatch: o-2: missing")

	_, err = pool.Exec(ctx, `INSERT INTO payments (order_id, payment_id, event_id, amount_cents) VALUES ('o-1', 'p', 'e3', 100)`)
	require.NoError(t, err)
	out, err = run(plan(), nil)
	require.Error(t, err)
	require.Contains(t, out, "mismatch: o-1: 2 payments for 200, want 1 for 100")
	require.Contains(t, out, "verdict: FAIL")
}

// Dead letters whose order was missing are replayed once their order
// exists, once per event id, with their original id, type, key and value;
// the others stay where they are.
func TestReplayable(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	ctx := context.Background()
	require.NoError(t, Migrate(ctx, pool))
	_, err := pool.Exec(ctx, `INSERT INTO orders (id, customer, amount_cents, status, created_event) VALUES ('o-1', 'c', 100, 'created', 'e0')`)
	require.NoError(t, err)
	unknown := func(id, order string, props bool) deadLetter {
		d := deadLetter{Key: []byte(order), Value: mustJSON(t, OrderPaid{OrderID: order, PaymentID: "p", AmountCents: 100}),
			Headers: map[string]string{consumer.HeaderEventID: id, consumer.HeaderErrorKind: "handler",
				consumer.HeaderErrorMessage: "retry after 250ms: " + ErrUnknownOrder.Error() + ": " + order}}
		if props {
			d.ID, d.Type = id, TypePaid // RabbitMQ: properties
		} else {
			d.Headers["id"], d.Headers["type"] = id, TypePaid // Kafka: headers
		}
		return d
	}
	other := unknown("e9", "o-1", false)
	other.Headers[consumer.HeaderErrorMessage] = ErrAlreadyPaid.Error()
	got, err := replayable(ctx, pool, []deadLetter{
		unknown("e1", "o-1", false),
		unknown("e1", "o-1", false),     // the same dead letter twice
		unknown("e2", "o-1", true),      // RabbitMQ properties
		unknown("e3", "o-ghost", false), // its order never came
		other,
	})
	require.NoError(t, err)
	require.Len(t, got, 2)
	want := mustJSON(t, OrderPaid{OrderID: "o-1", PaymentID: "p", AmountCents: 100})
	require.Equal(t, outMsg{Key: "o-1", Value: want, ID: "e1", Type: TypePaid}, got[0], "the dead letter's own value, replayed unchanged")
	require.Equal(t, "e2", got[1].ID)
	require.Equal(t, TypePaid, got[1].Type)
	require.Equal(t, want, got[1].Value)
}
