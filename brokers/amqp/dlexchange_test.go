package amqp_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
)

// TestDeadLetterExchangeAmongTheExchangesTakesItsKind: the dead-letter
// copies go to one of the exchanges the source declares (a topic exchange
// the queue is bound to), with a routing key its binding does not match.
// DeadLetter.ExchangeKind is left unset: the exchange is the one declared
// in Exchanges, of that kind. Before, it was declared a second time as
// "direct" (ExchangeKind's default), and Open failed with the broker's
// "inequivalent arg 'type'", naming a kind the configuration never gave.
func TestDeadLetterExchangeAmongTheExchangesTakesItsKind(t *testing.T) {
	a := newAdmin(t)
	q := queueName(t)
	a.cleanupQueue(q)
	x := q + ".events"
	t.Cleanup(func() {
		if ch, err := a.channel(); err == nil {
			_ = ch.ExchangeDelete(x, false, false)
		}
	})
	src := openSource(t, amqp.Config{
		Queue:      q,
		Exchanges:  []amqp.Exchange{{Name: x, Kind: "topic"}},
		Bindings:   []amqp.Binding{{Exchange: x, RoutingKey: "order.*"}},
		DeadLetter: amqp.DeadLetterConfig{Exchange: x, RoutingKey: "dead.order"},
	})
	require.NoError(t, a.publish(x, "order.created", jsonMsg("ev-1", `{}`)))
	d := receive(t, src)
	require.NoError(t, deadLetterWithRetries(d, 1))
	require.NoError(t, d.Ack(context.Background()))
	got, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, got, 1)
	assert.Equal(t, "ev-1", got[0].MessageId)
}

// TestDeadLetterExchangeKindContradictingItsDeclarationRefused: an
// ExchangeKind other than the Kind the same exchange has in Exchanges
// cannot be declared both ways; Open says so, naming both fields.
func TestDeadLetterExchangeKindContradictingItsDeclarationRefused(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := amqp.Open(ctx, amqp.Config{
		URL:        "amqp://u:secret@127.0.0.1:1/",
		Queue:      "q",
		Exchanges:  []amqp.Exchange{{Name: "events", Kind: "topic"}},
		DeadLetter: amqp.DeadLetterConfig{Exchange: "events", ExchangeKind: "fanout", RoutingKey: "dead"},
	})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "Config.DeadLetter.ExchangeKind")
	assert.Contains(t, err.Error(), "Config.Exchanges[0].Kind")
}

// TestDeadLetterRoutedBackIntoTheQueueRefused: a dead-letter exchange the
// source's queue is bound to, with a binding that matches the copies'
// routing key, routes every copy back into the queue as well: the consumer
// takes it for a new message, fails on it again and dead-letters it again,
// without end (as a CC header did: TestDeadLetterCopyIsNotRoutedByTheOriginalsCC).
// Open refuses such a configuration, naming the binding; bindings that do
// not match the key are accepted (TestDeadLetterExchangeAmongTheExchangesTakesItsKind).
func TestDeadLetterRoutedBackIntoTheQueueRefused(t *testing.T) {
	for _, tc := range []struct {
		name, kind, binding, key string
	}{
		{"direct, same key", "direct", "dead", "dead"},
		{"default kind, same key", "", "dead", "dead"},
		{"fanout", "fanout", "order", "dead"},
		{"topic hash", "topic", "#", "dead"},
		{"topic star", "topic", "*.dead", "orders.dead"},
		{"topic hash in the middle", "topic", "orders.#.dead", "orders.dead"},
		{"topic exact", "topic", "orders.dead", "orders.dead"},
		// A headers exchange routes by headers: the copies carry the
		// original headers, which matched the binding the original came by.
		{"headers", "headers", "", "dead"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			_, err := amqp.Open(ctx, amqp.Config{
				URL:        "amqp://u:secret@127.0.0.1:1/",
				Queue:      "q",
				Exchanges:  []amqp.Exchange{{Name: "events", Kind: tc.kind}},
				Bindings:   []amqp.Binding{{Exchange: "other", RoutingKey: tc.key}, {Exchange: "events", RoutingKey: tc.binding}},
				DeadLetter: amqp.DeadLetterConfig{Exchange: "events", RoutingKey: tc.key},
			})
			require.Error(t, err)
			assert.Contains(t, err.Error(), "Config.DeadLetter.RoutingKey")
			assert.Contains(t, err.Error(), "Config.Bindings[1]")
		})
	}
}

// TestTopicMatch: the topic exchange's matching, as RabbitMQ does it.
func TestTopicMatch(t *testing.T) {
	for _, tc := range []struct {
		pattern, key string
		want         bool
	}{
		{"#", "", true},
		{"#", "a.b.c", true},
		{"*", "a", true},
		{"*", "a.b", false},
		{"*", "", false},
		{"a.*", "a.b", true},
		{"a.*", "a", false},
		{"a.#", "a", true},
		{"a.#", "a.b.c", true},
		{"a.#.c", "a.c", true},
		{"a.#.c", "a.b.b.c", true},
		{"a.#.c", "a.b.d", false},
		{"#.c", "c", true},
		{"*.c", "c", false},
		{"a.b", "a.b", true},
		{"a.b", "a.c", false},
		{"order.*", "dead.order", false},
	} {
		assert.Equal(t, tc.want, amqp.TopicMatch(tc.pattern, tc.key), "%q %q", tc.pattern, tc.key)
	}
}
