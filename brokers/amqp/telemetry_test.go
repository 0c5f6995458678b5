package amqp

import (
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"go.opentelemetry.io/otel/attribute"

	"github.com/onceco/once/consumer"
)

// A delivery names its destination as the OpenTelemetry messaging
// conventions do for RabbitMQ: the exchange, the routing key apart, the
// queue as the subscription.
func TestDeliveryTelemetryAttributes(t *testing.T) {
	var _ consumer.TelemetryAttributer = (*delivery)(nil)
	for exchange, want := range map[string]string{"orders": "orders", "": "amq.default"} {
		d := &delivery{d: amqp091.Delivery{Exchange: exchange, RoutingKey: "order.paid"}, msg: consumer.Message{Topic: "billing"}}
		assert.ElementsMatch(t, []attribute.KeyValue{
			attribute.String("messaging.destination.name", want),
			attribute.String("messaging.rabbitmq.destination.routing_key", "order.paid"),
			attribute.String("messaging.destination.subscription.name", "billing"),
		}, d.TelemetryAttributes())
	}
}
