package amqp_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"log/slog"
	"net/url"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

func TestMessageFromDelivery(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.cleanupQueue(q)
	exchange := q + ".events"
	t.Cleanup(func() {
		if ch, err := a.channel(); err == nil {
			_ = ch.ExchangeDelete(exchange, false, false)
		}
	})
	src := openSource(t, amqp.Config{
		Queue:     q,
		Exchanges: []amqp.Exchange{{Name: exchange, Kind: "topic"}},
		Bindings:  []amqp.Binding{{Exchange: exchange, RoutingKey: "order.*"}},
	})
	assert.Equal(t, "rabbitmq", src.MessagingSystem())
	var _ consumer.SystemNamer = src

	ts := time.Date(2026, 11, 22, 1, 2, 3, 0, time.UTC)
	require.NoError(t, a.publish(exchange, "order.created", amqp091.Publishing{
		MessageId: "ev-1",
		Type:      "order.created",
		Timestamp: ts,
		Headers:   amqp091.Table{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "n": int32(7)},
		Body:      []byte(`{"n":1}`),
	}))
	require.NoError(t, a.publish(exchange, "invoice.created", jsonMsg("not-bound", `{}`)))

	d := receive(t, src)
	m := d.Message()
	assert.Equal(t, "ev-1", m.ID)
	assert.Equal(t, "order.created", m.Type)
	assert.Equal(t, []byte(`{"n":1}`), m.Value)
	assert.Equal(t, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", m.Headers["traceparent"])
	assert.Equal(t, "7", m.Headers["n"])
	assert.Equal(t, q, m.Topic)
	assert.Equal(t, []byte("order.created"), m.Key, "the routing key")
	assert.Equal(t, int32(-1), m.Partition)
	assert.Equal(t, int64(-1), m.Offset)
	assert.True(t, ts.Equal(m.Timestamp), "timestamp %v", m.Timestamp)
	assert.Empty(t, m.Stream, "AMQP promises no order across concurrent deliveries")
	assert.Empty(t, m.FallbackID, "no fallback id unless Config.FallbackID")
	assert.False(t, m.Redelivered)
	assert.Zero(t, m.DeliveryCount)
	assert.NoError(t, d.Context().Err())
	require.NoError(t, d.Ack(context.Background()))
	assert.Error(t, d.Ack(context.Background()), "a second ack is refused")

	require.NoError(t, src.Close())
	ready, err := a.ready(q)
	require.NoError(t, err)
	assert.Zero(t, ready, "the acked message is gone and the unbound routing key never arrived")
	_, err = src.Receive(context.Background())
	assert.ErrorIs(t, err, consumer.ErrSourceClosed)
}

// TestUnackedIsRedelivered: a delivery that is never acked comes back to
// the next source with the redelivered flag, and quorum queues count it.
func TestUnackedIsRedelivered(t *testing.T) {
	t.Parallel()
	for _, typ := range []amqp.QueueType{amqp.QueueClassic, amqp.QueueQuorum} {
		t.Run(string(typ), func(t *testing.T) {
			t.Parallel()
			a := newAdmin(t)
			q := queueName(t)
			a.declare(q, typ)
			require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))

			src := openSource(t, amqp.Config{Queue: q, QueueType: typ})
			first := receive(t, src)
			assert.False(t, first.Message().Redelivered)
			require.NoError(t, src.Close())
			assert.Error(t, first.Context().Err(), "closing the source cancels its deliveries")
			assert.ErrorIs(t, first.Ack(context.Background()), amqp.ErrChannelClosed)

			src2 := openSource(t, amqp.Config{Queue: q, QueueType: typ})
			again := receive(t, src2)
			assert.Equal(t, "ev-1", again.Message().ID)
			assert.True(t, again.Message().Redelivered)
			if typ == amqp.QueueQuorum {
				assert.Equal(t, 1, again.Message().DeliveryCount)
			} else {
				assert.Zero(t, again.Message().DeliveryCount, "classic queues do not count deliveries")
			}
			require.NoError(t, again.Ack(context.Background()))
		})
	}
}

func TestOrderedPutsTheQueueOnOneStream(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`), jsonMsg("ev-2", `{}`)))
	src := openSource(t, amqp.Config{Queue: q, Ordered: true})
	for _, id := range []string{"ev-1", "ev-2"} {
		d := receive(t, src)
		assert.Equal(t, id, d.Message().ID, "queue order")
		assert.Equal(t, q, d.Message().Stream)
		require.NoError(t, d.Ack(context.Background()))
	}
}

func TestFallbackIDOptIn(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	body := []byte(`{"same":"body"}`)
	require.NoError(t, a.publish("", q,
		amqp091.Publishing{Body: body},
		amqp091.Publishing{Body: body},
		amqp091.Publishing{Body: []byte(`{"other":"body"}`)},
		amqp091.Publishing{Body: body, Type: "order.cancelled"}))
	src := openSource(t, amqp.Config{Queue: q, FallbackID: true})
	sum := sha256.Sum256([]byte("\x00" + q + "\x00\x00" + string(body)))
	want := amqp.FallbackIDPrefix + hex.EncodeToString(sum[:])
	var got []string
	for range 4 {
		d := receive(t, src)
		assert.Empty(t, d.Message().ID)
		got = append(got, d.Message().FallbackID)
		require.NoError(t, d.Ack(context.Background()))
	}
	assert.Equal(t, want, got[0], "sha256 of exchange, routing key, type and body")
	assert.Equal(t, got[0], got[1], "identical messages share the fallback id")
	assert.NotEqual(t, got[0], got[2])
	assert.NotEqual(t, got[0], got[3], "another event type with the same body is another event")
}

// TestConnectionLossCancelsDeliveries cuts the TCP connection under a
// source: the deliveries of the dead channel are cancelled and cannot be
// acked, Receive reconnects by itself, the broker delivers the message
// again and the reconnection is counted in the metric.
func TestConnectionLossCancelsDeliveries(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
	p, proxied := startProxy(t, brokerURL(t))
	rd := sdkmetric.NewManualReader()
	logs := &syncBuffer{}
	src := openSource(t, amqp.Config{URL: proxied, Queue: q, MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd)),
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	u, err := url.Parse(proxied)
	require.NoError(t, err)
	password, _ := u.User.Password()

	first := receive(t, src)
	require.NoError(t, first.Context().Err())
	cutTheConnection(t, p)
	require.Eventually(t, func() bool { return first.Context().Err() != nil }, 10*time.Second, 5*time.Millisecond,
		"the delivery's context must end with its channel")
	assert.ErrorIs(t, first.Ack(context.Background()), amqp.ErrChannelClosed)
	assert.ErrorIs(t, first.DeadLetter(context.Background(), &consumer.DeadLetter{Kind: consumer.KindHandler}), amqp.ErrChannelClosed)

	again := receive(t, src) // reconnects
	assert.Equal(t, "ev-1", again.Message().ID)
	assert.True(t, again.Message().Redelivered)
	require.NoError(t, again.Ack(context.Background()))
	assert.Equal(t, int64(1), counterValue(t, rd, amqp.ReconnectsMetric))
	assert.Contains(t, logs.String(), "connection to the broker lost")
	assert.Contains(t, logs.String(), "reconnected to the broker")
	assert.Contains(t, logs.String(), ":xxxxx@", "the broker URL is logged redacted")
	assert.NotContains(t, logs.String(), ":"+password+"@", "the password leaked into the logs")
	require.Eventually(t, func() bool {
		n, err := a.ready(q)
		return err == nil && n == 0
	}, 10*time.Second, 10*time.Millisecond)
}

// TestDeadLetterCopy checks the dead-letter record: original body,
// properties and headers, the diagnostic headers, persistent, and the
// original delivery left unsettled.
func TestDeadLetterCopy(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	ts := time.Date(2026, 11, 22, 1, 2, 3, 0, time.UTC)
	body := []byte("\x00original bytes\xff")
	require.NoError(t, a.publish("", q, amqp091.Publishing{
		MessageId:     "ev-poison",
		Type:          "thing.happened",
		ContentType:   "application/octet-stream",
		CorrelationId: "corr-1",
		AppId:         "producer-app",
		Expiration:    "600000",
		Priority:      3,
		Timestamp:     ts,
		DeliveryMode:  amqp091.Transient,
		Headers:       amqp091.Table{"x-custom": "kept", "n": int64(42), "once-error-kind": "overwritten"},
		Body:          body,
	}))
	src := openSource(t, amqp.Config{Queue: q})
	d := receive(t, src)
	failedAt := time.Date(2026, 11, 22, 1, 5, 0, 0, time.UTC)
	require.NoError(t, d.DeadLetter(context.Background(), &consumer.DeadLetter{
		Kind: consumer.KindHandler, Error: "business rule violated", Consumer: "orders-svc",
		EventID: "ev-poison", EventType: "thing.happened", Attempts: 3, FailedAt: failedAt,
	}))

	dlq, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, dlq, 1)
	c := dlq[0]
	assert.Equal(t, body, c.Body)
	assert.Equal(t, "ev-poison", c.MessageId)
	assert.Equal(t, "thing.happened", c.Type)
	assert.Equal(t, "application/octet-stream", c.ContentType)
	assert.Equal(t, "corr-1", c.CorrelationId)
	assert.Equal(t, "producer-app", c.AppId)
	assert.Equal(t, uint8(3), c.Priority)
	assert.True(t, ts.Equal(c.Timestamp))
	assert.Equal(t, amqp091.Persistent, c.DeliveryMode, "copies survive a broker restart")
	assert.Empty(t, c.Expiration, "the copy must not expire from the dead-letter queue")
	h := amqp.HeaderStrings(c.Headers)
	assert.Equal(t, "kept", h["x-custom"])
	assert.Equal(t, int64(42), c.Headers["n"], "original headers keep their types")
	assert.Equal(t, "600000", h[amqp.HeaderOriginalExpiration])
	assert.Equal(t, "", h[amqp.HeaderOriginalExchange])
	assert.Equal(t, q, h[amqp.HeaderOriginalRoutingKey])
	assert.Equal(t, q, h[amqp.HeaderOriginalQueue])
	assert.Equal(t, q, h[consumer.HeaderOriginalTopic])
	assert.Equal(t, "handler", h[consumer.HeaderErrorKind], "diagnostic headers win over original ones")
	assert.Equal(t, "business rule violated", h[consumer.HeaderErrorMessage])
	assert.Equal(t, "orders-svc", h[consumer.HeaderConsumer])
	assert.Equal(t, "ev-poison", h[consumer.HeaderEventID])
	assert.Equal(t, "3", h[consumer.HeaderAttempts])
	assert.Equal(t, "2026-11-22T01:05:00Z", h[consumer.HeaderFailedAt])
	assert.NotContains(t, h, consumer.HeaderOriginalPartition)

	// DeadLetter does not settle: closing without Ack puts it back.
	require.NoError(t, src.Close())
	require.Eventually(t, func() bool {
		n, err := a.ready(q)
		return err == nil && n == 1
	}, 10*time.Second, 10*time.Millisecond)
}

// TestDeadLetterFailures: a copy the broker nacks or cannot route is an
// error, so the consumer retries instead of acking a message whose copy
// does not exist.
func TestDeadLetterFailures(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	dlx := q + ".dlx"
	full := q + ".full"
	t.Cleanup(func() {
		if ch, err := a.channel(); err == nil {
			_ = ch.ExchangeDelete(dlx, false, false)
			_, _ = ch.QueueDelete(full, false, false, false)
		}
	})
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
	src := openSource(t, amqp.Config{Queue: q, DeadLetter: amqp.DeadLetterConfig{Exchange: dlx, RoutingKey: "poison", NoQueue: true}})
	d := receive(t, src)
	dl := &consumer.DeadLetter{Kind: consumer.KindDecode, FailedAt: time.Now()}

	err := d.DeadLetter(context.Background(), dl)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "unroutable")

	// A queue that rejects every publish: the broker nacks the copy.
	ch, err := a.channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(full, true, false, false, false, amqp091.Table{"x-max-length": int32(0), "x-overflow": "reject-publish"})
	require.NoError(t, err)
	require.NoError(t, ch.QueueBind(full, "poison", dlx, false, nil))
	err = d.DeadLetter(context.Background(), dl)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "nacked")

	require.NoError(t, d.Ack(context.Background()), "the delivery stays usable after failed copies")
}

func TestPassiveTopology(t *testing.T) {
	t.Parallel()
	q := queueName(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := amqp.Open(ctx, amqp.Config{URL: brokerURL(t), Queue: q, Passive: true, Logger: testLogger(t)})
	require.Error(t, err, "a missing queue fails at once in passive mode")
	assert.Contains(t, err.Error(), q)
	assert.Contains(t, err.Error(), "NOT_FOUND")
	assert.NoError(t, ctx.Err(), "configuration errors are not retried")

	a := newAdmin(t)
	a.declare(q, amqp.QueueQuorum)
	_, err = amqp.Open(ctx, amqp.Config{URL: brokerURL(t), Queue: q, Passive: true, Logger: testLogger(t)})
	require.Error(t, err, "the dead-letter queue is missing")
	assert.Contains(t, err.Error(), q+amqp.DeadLetterQueueSuffix)

	a.declare(q+amqp.DeadLetterQueueSuffix, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
	src := openSource(t, amqp.Config{Queue: q, Passive: true})
	d := receive(t, src)
	assert.Equal(t, "ev-1", d.Message().ID)
	require.NoError(t, d.Ack(context.Background()))
}

func TestWrongCredentialsFailFast(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(brokerURL(t))
	require.NoError(t, err)
	u.User = url.UserPassword("guest", "wrong-password")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err = amqp.Open(ctx, amqp.Config{URL: u.String(), Queue: queueName(t), Logger: testLogger(t)})
	require.Error(t, err)
	assert.NoError(t, ctx.Err(), "refused credentials are not retried")
	assert.Contains(t, err.Error(), "xxxxx")
	assert.NotContains(t, err.Error(), "wrong-password")
}

// TestDeadLetterConfirmTimeout: when the broker's confirm does not come
// within Config.ConfirmTimeout (here the traffic to the broker is held by
// the proxy), DeadLetter returns an error instead of blocking, and works
// again once the broker answers.
func TestDeadLetterConfirmTimeout(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
	p, proxied := startProxy(t, brokerURL(t))
	src := openSource(t, amqp.Config{URL: proxied, Queue: q, ConfirmTimeout: 300 * time.Millisecond})
	d := receive(t, src)
	dl := &consumer.DeadLetter{Kind: consumer.KindHandler, EventID: "ev-1", FailedAt: time.Now()}
	require.NoError(t, d.DeadLetter(context.Background(), dl), "opens the publishing channel while the broker answers")

	p.Pause()
	start := time.Now()
	err := d.DeadLetter(context.Background(), dl)
	p.Resume()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "Config.ConfirmTimeout")
	assert.Less(t, time.Since(start), 5*time.Second, "DeadLetter must not block past the timeout")

	require.NoError(t, d.DeadLetter(context.Background(), dl), "a fresh publishing channel works")
	require.NoError(t, d.Ack(context.Background()))
	require.Eventually(t, func() bool {
		n, err := a.ready(q + amqp.DeadLetterQueueSuffix)
		return err == nil && n >= 2
	}, 10*time.Second, 10*time.Millisecond, "the confirmed copies are in the dead-letter queue")
}

// TestPrefetchAppliedAfterReconnect: the broker hands out no more than
// Config.Prefetch unacked deliveries, before and after a reconnect.
func TestPrefetchAppliedAfterReconnect(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, messagesFor(eventIDs("qos", 5))...))
	p, proxied := startProxy(t, brokerURL(t))
	src := openSource(t, amqp.Config{URL: proxied, Queue: q, Prefetch: 2})

	withheld := func() {
		t.Helper()
		receive(t, src)
		receive(t, src)
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		d, err := src.Receive(ctx)
		assert.ErrorIs(t, err, context.DeadlineExceeded, "a third unacked delivery arrived: %v", d)
	}
	withheld()
	cutTheConnection(t, p)
	withheld() // the two redelivered ones, and again no third
}

// TestQueueDeletedIsDeclaredAgain: when the queue is deleted under the
// source, the broker cancels the consumer; the source reconnects, declares
// the queue again and consumes what is published next.
func TestQueueDeletedIsDeclaredAgain(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.cleanupQueue(q)
	src := openSource(t, amqp.Config{Queue: q})
	got := make(chan consumer.Delivery, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		d, err := src.Receive(ctx)
		if err == nil {
			got <- d
		}
		close(got)
	}()
	ch, err := a.channel()
	require.NoError(t, err)
	_, err = ch.QueueDelete(q, false, false, false)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		_, err := a.ready(q)
		return err == nil
	}, 20*time.Second, 10*time.Millisecond, "the source declares the queue again")
	require.NoError(t, a.publish("", q, jsonMsg("after-delete", `{}`)))
	d, ok := <-got
	require.True(t, ok, "Receive failed")
	assert.Equal(t, "after-delete", d.Message().ID)
	require.NoError(t, d.Ack(context.Background()))
}

// syncBuffer is a bytes.Buffer safe for concurrent use, for logs.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// The dead-letter queue the source declares takes arguments of its own
// (DeadLetter.QueueArgs): on RabbitMQ 4 a quorum queue has a delivery limit
// of 20 unless declared with x-delivery-limit -1, and every read of the
// dead letters by once dlq or the console counts as a delivery.
func TestDeadLetterQueueArgs(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.cleanupQueue(q)
	openSource(t, amqp.Config{Queue: q, QueueType: amqp.QueueQuorum,
		DeadLetter: amqp.DeadLetterConfig{QueueArgs: amqp091.Table{"x-max-length": int64(1000)}}})
	ch, err := a.channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(q+amqp.DeadLetterQueueSuffix, true, false, false, false,
		amqp091.Table{"x-queue-type": "quorum", "x-max-length": int64(1000)})
	require.NoError(t, err, "declared with its arguments, and of the source's QueueType")
	_, err = ch.QueueDeclare(q+amqp.DeadLetterQueueSuffix, true, false, false, false,
		amqp091.Table{"x-queue-type": "quorum", "x-max-length": int64(5)})
	require.ErrorContains(t, err, "x-max-length", "the broker holds the queue's own arguments")
}

// TestPublishedDeliveryCountIsNoRedelivery: a message published with an
// x-delivery-count header (a copy an application or a shovel republished
// from a quorum queue, or a dead letter of this source, which keeps the
// original headers) keeps it on its first delivery, from a classic queue
// and from a quorum queue alike (RabbitMQ 3.10 writes its count only on a
// redelivery). Reported as Message.DeliveryCount, it had the consumer take
// every such first delivery for a redelivery: run alone, one at a time,
// with a crash-guard write. The count is the broker's only on a
// redelivery, which the quorum queue then counts afresh.
func TestPublishedDeliveryCountIsNoRedelivery(t *testing.T) {
	t.Parallel()
	for _, typ := range []amqp.QueueType{amqp.QueueClassic, amqp.QueueQuorum} {
		t.Run(string(typ), func(t *testing.T) {
			t.Parallel()
			a := newAdmin(t)
			q := queueName(t)
			a.declare(q, typ)
			msg := jsonMsg("ev-1", `{}`)
			msg.Headers = amqp091.Table{amqp.DeliveryCountHeader: int64(4)}
			require.NoError(t, a.publish("", q, msg))

			src := openSource(t, amqp.Config{Queue: q, QueueType: typ})
			first := receive(t, src).Message()
			assert.False(t, first.Redelivered)
			assert.Zero(t, first.DeliveryCount, "a first delivery with the publisher's count")
			assert.Equal(t, "4", first.Headers[amqp.DeliveryCountHeader], "the header itself is kept")
			require.NoError(t, src.Close())

			again := receive(t, openSource(t, amqp.Config{Queue: q, QueueType: typ})).Message()
			assert.True(t, again.Redelivered)
			if typ == amqp.QueueQuorum {
				assert.Equal(t, 1, again.DeliveryCount, "the broker's own count")
			}
		})
	}
}
