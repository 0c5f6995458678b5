package amqp_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// declareInternal (re)declares exchange x as an internal direct exchange,
// which refuses every publish (ACCESS_REFUSED), and binds queue to it
// with key; x is deleted when the test ends.
func (a *admin) declareInternal(x, queue, key string) {
	a.t.Helper()
	ch, err := a.channel()
	require.NoError(a.t, err)
	require.NoError(a.t, ch.ExchangeDelete(x, false, false))
	require.NoError(a.t, ch.ExchangeDeclare(x, "direct", true, false, true, false, nil))
	if queue != "" {
		require.NoError(a.t, ch.QueueBind(queue, key, x, false, nil))
	}
	a.t.Cleanup(func() {
		if ch, err := a.channel(); err == nil {
			_ = ch.ExchangeDelete(x, false, false)
		}
	})
}

// TestDeadLetterRefusedByTheBrokerIsAnError: a dead-letter exchange the
// broker refuses the source's publishes to (made internal since Open, or
// the user's write permission taken away) fails every copy with
// ACCESS_REFUSED, which no retry cures until it is fixed on the broker.
// Each refusal is logged at level Error naming the exchange, and counted
// in DeadLetterRefusalsMetric, not logged as a passing failure; the
// delivery stays unacked, and the copy goes out once the exchange takes it
// again.
func TestDeadLetterRefusedByTheBrokerIsAnError(t *testing.T) {
	a := newAdmin(t)
	q := queueName(t)
	a.cleanupQueue(q)
	x := q + ".dlx"
	dlq := q + amqp.DeadLetterQueueSuffix
	logs := make(logRecords, 1024)
	rd := sdkmetric.NewManualReader()
	src := openSource(t, amqp.Config{Queue: q, DeadLetter: amqp.DeadLetterConfig{Exchange: x},
		Logger: slog.New(logs), MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd))})
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
	d := receive(t, src)

	a.declareInternal(x, dlq, dlq)
	for i := 1; i <= 2; i++ {
		err := deadLetterWithRetries(d, 1)
		require.Error(t, err)
		var ae *amqp091.Error
		require.True(t, errors.As(err, &ae), "%v", err)
		assert.Equal(t, amqp091.AccessRefused, ae.Code)
		errText := awaitLog(t, logs, slog.LevelError, "refuses")
		assert.Contains(t, errText, x)
		assert.Equal(t, int64(i), counterValue(t, rd, amqp.DeadLetterRefusalsMetric))
	}

	// Fixed on the broker: the copy goes out.
	ch, err := a.channel()
	require.NoError(t, err)
	require.NoError(t, ch.ExchangeDelete(x, false, false))
	require.NoError(t, ch.ExchangeDeclare(x, "direct", true, false, false, false, nil))
	require.NoError(t, ch.QueueBind(dlq, dlq, x, false, nil))
	require.NoError(t, deadLetterWithRetries(d, 1))
	require.NoError(t, d.Ack(context.Background()))
	got, err := a.getAll(dlq)
	require.NoError(t, err)
	require.Len(t, got, 1)
	assert.Equal(t, "ev-1", got[0].MessageId)
}

// TestOpenRefusesAnInternalDeadLetterExchange: with Passive, the
// dead-letter exchange is only checked to exist, and an internal one
// passes that check (a declaration, without Passive, is refused by the
// broker as inequivalent). The broker would refuse every copy published
// to it: Open finds that out, without a message reaching any queue, and
// refuses, naming the exchange.
func TestOpenRefusesAnInternalDeadLetterExchange(t *testing.T) {
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	dlq := q + amqp.DeadLetterQueueSuffix
	a.declare(dlq, amqp.QueueClassic)
	x := q + ".dlx"
	a.declareInternal(x, dlq, dlq)
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := amqp.Open(ctx, amqp.Config{URL: brokerURL(t), Queue: q, Passive: true,
		DeadLetter: amqp.DeadLetterConfig{Exchange: x, RoutingKey: dlq, Queue: dlq}, Logger: testLogger(t)})
	require.Error(t, err)
	t.Log(err)
	assert.NoError(t, ctx.Err(), "the refusal was retried until the context ended")
	assert.Contains(t, err.Error(), "Config.DeadLetter.Exchange")
	assert.Contains(t, err.Error(), x)
	assert.Contains(t, err.Error(), "ACCESS_REFUSED")
	n, err := a.ready(dlq)
	require.NoError(t, err)
	assert.Zero(t, n, "the check left a message in the dead-letter queue")
	ch, err := a.channel()
	require.NoError(t, err)
	st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
	require.NoError(t, err)
	assert.Zero(t, st.Consumers, "the refused source still consumes")
	// Checked before consuming: a message delivered to the refused source
	// and put back would come again marked redelivered, and be handled as
	// a crash suspect, isolated.
	got, err := a.getAll(q)
	require.NoError(t, err)
	require.Len(t, got, 1)
	assert.False(t, got[0].Redelivered, "the refused source took the message")
}

// TestOpenDeadLetterCheckPublishesNothing: the check Open makes that the
// broker accepts the dead-letter copies leaves nothing in the dead-letter
// queue, on the default exchange as on a named one, and the source's
// dead letters go out as before.
func TestOpenDeadLetterCheckPublishesNothing(t *testing.T) {
	for _, x := range []string{"", "named"} {
		t.Run("exchange "+x, func(t *testing.T) {
			a := newAdmin(t)
			q := queueName(t)
			a.cleanupQueue(q)
			cfg := amqp.Config{Queue: q}
			if x != "" {
				cfg.DeadLetter.Exchange = q + ".dlx"
				t.Cleanup(func() {
					if ch, err := a.channel(); err == nil {
						_ = ch.ExchangeDelete(q+".dlx", false, false)
					}
				})
			}
			src := openSource(t, cfg)
			n, err := a.ready(q + amqp.DeadLetterQueueSuffix)
			require.NoError(t, err)
			assert.Zero(t, n)
			require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
			d := receive(t, src)
			require.NoError(t, d.DeadLetter(context.Background(), &consumer.DeadLetter{Kind: consumer.KindHandler, EventID: "ev-1", FailedAt: time.Now()}))
			require.NoError(t, d.Ack(context.Background()))
			got, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
			require.NoError(t, err)
			require.Len(t, got, 1)
		})
	}
}

// TestDeadLetterDestinationMissingUnderPassiveIsAnError: with Passive the
// source declares nothing, so a dead-letter queue or exchange deleted
// while it runs is not declared again (TestDeadLetterDestinationDeletedIsDeclaredAgain
// is the case without Passive): every copy fails, unroutable or on the
// missing exchange, until the topology's owner restores it. Each failure
// is logged at level Error saying so, not as a passing failure, and
// counted in DeadLetterRefusalsMetric; the
// delivery stays unacked, and the copy goes out once the destination is
// back.
func TestDeadLetterDestinationMissingUnderPassiveIsAnError(t *testing.T) {
	for _, tc := range []struct {
		name     string
		exchange bool // the exchange is deleted; else the queue is
	}{{"queue", false}, {"exchange", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			a := newAdmin(t)
			q := queueName(t)
			a.declare(q, amqp.QueueClassic)
			dlq := q + amqp.DeadLetterQueueSuffix
			x := q + ".dlx"
			ch, err := a.channel()
			require.NoError(t, err)
			restore := func() {
				t.Helper()
				require.NoError(t, ch.ExchangeDeclare(x, "direct", true, false, false, false, nil))
				_, err := ch.QueueDeclare(dlq, true, false, false, false, nil)
				require.NoError(t, err)
				require.NoError(t, ch.QueueBind(dlq, dlq, x, false, nil))
			}
			restore()
			t.Cleanup(func() {
				if ch, err := a.channel(); err == nil {
					_ = ch.ExchangeDelete(x, false, false)
				}
			})
			logs := make(logRecords, 1024)
			rd := sdkmetric.NewManualReader()
			src := openSource(t, amqp.Config{Queue: q, Passive: true, Logger: slog.New(logs),
				MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd)),
				DeadLetter:    amqp.DeadLetterConfig{Exchange: x, RoutingKey: dlq, Queue: dlq}})
			require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
			d := receive(t, src)

			if tc.exchange {
				require.NoError(t, ch.ExchangeDelete(x, false, false))
			} else {
				_, err = ch.QueueDelete(dlq, false, false, false)
				require.NoError(t, err)
			}
			for i := 1; i <= 2; i++ {
				require.Error(t, deadLetterWithRetries(d, 1))
				errText := awaitLog(t, logs, slog.LevelError, "Passive")
				assert.Contains(t, errText, x)
				// Counted as a refusal: only a change on the broker
				// ends it, and an alert on the counter sees it.
				assert.Equal(t, int64(i), counterValue(t, rd, amqp.DeadLetterRefusalsMetric))
			}

			restore()
			require.NoError(t, deadLetterWithRetries(d, 2))
			require.NoError(t, d.Ack(context.Background()))
			got, err := a.getAll(dlq)
			require.NoError(t, err)
			require.Len(t, got, 1)
		})
	}
}
