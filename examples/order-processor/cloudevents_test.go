package main

import (
	"context"
	"encoding/base64"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/IBM/sarama"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// structured returns a structured-mode CloudEvent carrying data.
func structured(t *testing.T, id, typ, at string, data any) []byte {
	t.Helper()
	return mustJSON(t, map[string]any{
		"specversion": "1.0", "id": id, "type": typ, "source": "/orders", "time": at,
		"datacontenttype": "application/json", "data": data,
	})
}

// The id and type rules on CloudEvents of both modes, and on the service's
// plain messages.
func TestCloudEventsIdentity(t *testing.T) {
	paid := OrderPaid{OrderID: "o-1", PaymentID: "pay-1", AmountCents: 100}
	data := mustJSON(t, paid)
	doc := structured(t, "ce-9", TypePaid, "2026-01-01T00:00:00Z", paid)
	b64 := mustJSON(t, map[string]any{"specversion": "1.0", "id": "ce-64", "type": TypePaid,
		"data_base64": base64.StdEncoding.EncodeToString(data)})
	for _, tc := range []struct {
		name     string
		m        consumer.Message
		id, typ  string
		envelope string // the payload the envelope opens
	}{
		{"kafka binary", consumer.Message{Value: data, Headers: map[string]string{"ce_id": "ce-1", "ce_type": TypePaid}}, "ce-1", TypePaid, string(data)},
		{"amqp binary", consumer.Message{Value: data, Headers: map[string]string{"cloudEvents_id": "ce-2", "cloudEvents_type": TypePaid}}, "ce-2", TypePaid, string(data)},
		{"amqp binary, old prefix", consumer.Message{Value: data, Headers: map[string]string{"cloudEvents:id": "ce-3", "cloudEvents:type": TypePaid}}, "ce-3", TypePaid, string(data)},
		{"amqp properties", consumer.Message{ID: "ce-4", Type: TypePaid, Value: data}, "ce-4", TypePaid, string(data)},
		{"structured", consumer.Message{Value: doc, FallbackID: "orders/0/7"}, "ce-9", TypePaid, string(data)},
		{"structured, base64 data", consumer.Message{Value: b64}, "ce-64", TypePaid, string(data)},
		{"structured without id", consumer.Message{Value: mustJSON(t, map[string]any{"specversion": "1.0", "type": TypePaid, "data": paid})}, "o-1/" + TypePaid, TypePaid, string(data)},
		{"plain, id header", consumer.Message{Value: data, Headers: map[string]string{"id": "h-1", "type": TypePaid}}, "h-1", "", string(data)},
		{"plain, derived", consumer.Message{Value: data, Headers: map[string]string{"type": TypePaid}}, "o-1/" + TypePaid, "", string(data)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, err := EventID(&tc.m)
			require.NoError(t, err)
			assert.Equal(t, tc.id, id)
			opened, err := CloudEventsEnvelope{}.Open(tc.m.Value)
			require.NoError(t, err)
			assert.JSONEq(t, tc.envelope, string(opened.Payload))
			if tc.typ != "" { // as the consumer finds it: properties and headers, then the envelope
				typ := eventType(&tc.m, nil)
				if typ == "" {
					typ = opened.Type
				}
				assert.Equal(t, tc.typ, typ)
			}
		})
	}

	// A re-send of a structured event with a new time attribute has the
	// same fingerprint; other data under the same id has another.
	again := structured(t, "ce-9", TypePaid, "2026-01-01T00:05:00Z", paid)
	other := structured(t, "ce-9", TypePaid, "2026-01-01T00:00:00Z", OrderPaid{OrderID: "o-1", PaymentID: "pay-2", AmountCents: 100})
	assert.Equal(t, Fingerprint(&consumer.Message{Value: doc}), Fingerprint(&consumer.Message{Value: again}))
	assert.NotEqual(t, Fingerprint(&consumer.Message{Value: doc}), Fingerprint(&consumer.Message{Value: other}))

	// Bytes that are not JSON pass through the envelope to the decoder,
	// which dead-letters them with their original bytes.
	opened, err := CloudEventsEnvelope{}.Open([]byte(`{"specversion": oops`))
	require.NoError(t, err)
	assert.Equal(t, `{"specversion": oops`, string(opened.Payload))
}

// ceRun is one consumer run of the service over a source, until every
// message it received is settled.
func ceRun(t *testing.T, o *options, src consumer.Source, want uint64) consumer.Stats {
	t.Helper()
	pool := pgtest.NewPool(t, o.schema)
	tel, err := startTelemetry("", "")
	require.NoError(t, err)
	t.Cleanup(func() { _ = tel.Close() })
	c, err := newConsumer(pool, src, o, tel, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx) }()
	require.Eventually(t, func() bool {
		s := c.Stats()
		return s.Received >= want && settled(s)
	}, 60*time.Second, 10*time.Millisecond, "the consumer settles the %d messages", want)
	cancel()
	require.NoError(t, <-errc)
	return c.Stats()
}

// A CloudEvents producer on Kafka sends each event twice (a re-send after
// a lost acknowledgement), in binary mode (ce_ headers) and in structured
// mode (with a new time attribute on the re-send): every event is handled
// once, every re-send skipped as a duplicate, nothing dead-lettered as an
// unknown type or a conflict.
func TestCloudEventsResendsSkippedOnKafka(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	require.NoError(t, Migrate(context.Background(), pool))
	k, err := startEmbeddedKafka(0, "orders", 2)
	require.NoError(t, err)
	t.Cleanup(k.Close)

	created := OrderCreated{OrderID: "o-ce", Customer: "c", AmountCents: 700}
	paid := OrderPaid{OrderID: "o-ce", PaymentID: "pay-ce", AmountCents: 700}
	binary := func(id, typ string, v any) *sarama.ProducerMessage {
		return &sarama.ProducerMessage{Topic: "orders", Key: sarama.StringEncoder("o-ce"), Value: sarama.ByteEncoder(mustJSON(t, v)),
			Headers: []sarama.RecordHeader{{Key: []byte("ce_id"), Value: []byte(id)}, {Key: []byte("ce_type"), Value: []byte(typ)},
				{Key: []byte("ce_specversion"), Value: []byte("1.0")}, {Key: []byte("ce_source"), Value: []byte("/orders")}}}
	}
	structuredMsg := func(id, typ, at string, v any) *sarama.ProducerMessage {
		return &sarama.ProducerMessage{Topic: "orders", Key: sarama.StringEncoder("o-ce"),
			Value:   sarama.ByteEncoder(structured(t, id, typ, at, v)),
			Headers: []sarama.RecordHeader{{Key: []byte("content-type"), Value: []byte(CloudEventsContentType)}}}
	}
	msgs := []*sarama.ProducerMessage{
		binary("ce-created", TypeCreated, created),
		binary("ce-created", TypeCreated, created), // re-send
		structuredMsg("ce-paid", TypePaid, "2026-01-01T00:00:00Z", paid),
		structuredMsg("ce-paid", TypePaid, "2026-01-01T00:00:07Z", paid), // re-send, new time
	}
	sc := saramaConfig()
	sc.Producer.Return.Successes = true
	p, err := sarama.NewSyncProducer(k.addrs, sc)
	require.NoError(t, err)
	require.NoError(t, p.SendMessages(msgs))
	require.NoError(t, p.Close())

	o := &options{broker: "kafka", kafkaBrokers: k.addrs, topic: "orders", name: "ce-" + schema, schema: schema,
		fastFailover: true, unknownOrderWait: 30 * time.Millisecond, maxAttempts: 3}
	tel, err := startTelemetry("", "")
	require.NoError(t, err)
	t.Cleanup(func() { _ = tel.Close() })
	src, err := kafkaSource(t.Context(), o, tel.MeterProvider(), slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)
	s := ceRun(t, o, src, uint64(len(msgs)))

	assert.EqualValues(t, 2, s.Handled)
	assert.EqualValues(t, 2, s.Duplicates, "each re-send is skipped")
	assert.Zero(t, s.DeadLettered)
	status, payments, sum := orderState(t, pool, "o-ce")
	assert.Equal(t, "paid", status)
	assert.Equal(t, 1, payments)
	assert.EqualValues(t, 700, sum)
	var ids []string
	rows, err := pool.Query(context.Background(), `SELECT event_id FROM processed_events ORDER BY event_id`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		ids = append(ids, id)
	}
	require.NoError(t, rows.Err())
	assert.Equal(t, []string{"ce-created", "ce-paid"}, ids, "the CloudEvent ids are the event ids")
}

// On RabbitMQ, where deliveries are handled concurrently, a payment and a
// cancellation that arrive before their order are retried (RetryAfter,
// bounded by the retry policy) until the order exists, then applied, not
// dead-lettered; CloudEvents re-sends in binary mode (cloudEvents_
// application properties) and structured mode are skipped.
func TestAMQPEarlyEventsWaitForTheirOrder(t *testing.T) {
	url := requireAMQP(t)
	pool, schema := pgtest.Schema(t)
	require.NoError(t, Migrate(context.Background(), pool))
	o := &options{broker: "amqp", amqpURL: url, topic: "orders-" + schema, name: "early-" + schema, schema: schema,
		unknownOrderWait: 100 * time.Millisecond, maxAttempts: 50}
	require.NoError(t, prepareAMQP(context.Background(), o))
	q, err := newAMQPQueues(url, o.topic)
	require.NoError(t, err)
	t.Cleanup(func() { _ = q.Delete(); _ = q.Close() })

	conn, err := amqp091.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	publish := func(p amqp091.Publishing) {
		t.Helper()
		require.NoError(t, ch.PublishWithContext(context.Background(), "", o.topic, false, false, p))
	}
	cloud := func(id, typ string, v any) amqp091.Publishing {
		return amqp091.Publishing{ContentType: "application/json", Body: mustJSON(t, v),
			Headers: amqp091.Table{"cloudEvents_id": id, "cloudEvents_type": typ, "cloudEvents_specversion": "1.0"}}
	}

	src, err := amqp.Open(context.Background(), amqpConfig(o, nil, slog.New(slog.NewTextHandler(io.Discard, nil))))
	require.NoError(t, err)
	pool2 := pgtest.NewPool(t, schema)
	tel, err := startTelemetry("", "")
	require.NoError(t, err)
	t.Cleanup(func() { _ = tel.Close() })
	c, err := newConsumer(pool2, src, o, tel, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx) }()
	defer func() {
		cancel()
		require.NoError(t, <-errc)
	}()

	// The payment of o-a and the cancellation of o-b, before their orders.
	publish(cloud("pay-a", TypePaid, OrderPaid{OrderID: "o-a", PaymentID: "p-a", AmountCents: 500}))
	publish(amqp091.Publishing{ContentType: CloudEventsContentType,
		Body: structured(t, "cancel-b", TypeCancelled, "2026-01-01T00:00:00Z", OrderCancelled{OrderID: "o-b", Reason: "r"})})
	// Both are retried while their orders are missing...
	require.Eventually(t, func() bool { return c.Stats().Retries >= 4 }, 30*time.Second, 10*time.Millisecond)
	assert.Zero(t, c.Stats().DeadLettered, "an event before its order is not dead-lettered at once")
	// ...and applied once the orders arrive, each re-sent as well.
	for range 2 {
		publish(cloud("create-a", TypeCreated, OrderCreated{OrderID: "o-a", Customer: "c", AmountCents: 500}))
		publish(amqp091.Publishing{ContentType: CloudEventsContentType,
			Body: structured(t, "create-b", TypeCreated, time.Now().Format(time.RFC3339Nano), OrderCreated{OrderID: "o-b", Customer: "c", AmountCents: 600})})
	}
	publish(cloud("pay-a", TypePaid, OrderPaid{OrderID: "o-a", PaymentID: "p-a", AmountCents: 500})) // re-send of the payment

	require.Eventually(t, func() bool {
		s := c.Stats()
		return s.Received == 7 && settled(s)
	}, 60*time.Second, 10*time.Millisecond)
	s := c.Stats()
	assert.EqualValues(t, 4, s.Handled, "two orders, a payment, a cancellation")
	assert.EqualValues(t, 3, s.Duplicates, "the re-sends")
	assert.Zero(t, s.DeadLettered)
	status, payments, sum := orderState(t, pool, "o-a")
	assert.Equal(t, "paid", status)
	assert.Equal(t, 1, payments)
	assert.EqualValues(t, 500, sum)
	status, _, _ = orderState(t, pool, "o-b")
	assert.Equal(t, "cancelled", status)
	dead, err := q.DeadLetters()
	require.NoError(t, err)
	assert.Empty(t, dead)
}
