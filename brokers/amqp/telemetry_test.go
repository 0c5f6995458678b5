package amqp

import (
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"go.opentelemetry.io/otel/attribute"

	"github.com/onceco/once/consumer"
)

// A delivery names its destination as the OpenTelemetry messaging
// conventions do for a RabbitMQ consumer: {exchange}:{routing key}:{queue},
// empty parts left out and a routing key equal to the queue given once, so
// that a message published to the default exchange with the queue's name
// has the queue as its destination, as the consumer's metrics do; the
// routing key apart, the queue as the subscription.
func TestDeliveryTelemetryAttributes(t *testing.T) {
	var _ consumer.TelemetryAttributer = (*delivery)(nil)
	for _, tc := range []struct{ exchange, key, want string }{
		{"orders", "order.paid", "orders:order.paid:billing"},
		{"", "order.paid", "order.paid:billing"},
		{"", "billing", "billing"},              // the default exchange, to the queue: the metrics' destination
		{"orders", "billing", "orders:billing"}, // the routing key equal to the queue, once
		{"orders", "", "orders:billing"},        // a fanout exchange
	} {
		d := &delivery{d: amqp091.Delivery{Exchange: tc.exchange, RoutingKey: tc.key}, msg: consumer.Message{Topic: "billing"}}
		want := []attribute.KeyValue{
			attribute.String("messaging.destination.name", tc.want),
			attribute.String("messaging.destination.subscription.name", "billing"),
		}
		if tc.key != "" {
			want = append(want, attribute.String("messaging.rabbitmq.destination.routing_key", tc.key))
		}
		assert.ElementsMatch(t, want, d.TelemetryAttributes(), "exchange %q, routing key %q", tc.exchange, tc.key)
	}
}
