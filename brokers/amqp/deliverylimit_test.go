package amqp_test

import (
	"context"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
)

// TestDeliveryLimitBelowOneRefusedBeforeRabbitMQ4: the docs' Pitfalls
// tell RabbitMQ 4 users to declare quorum queues with x-delivery-limit -1
// (unlimited). RabbitMQ 3 takes a limit below 1 for 0: a quorum queue so
// declared drops a message at its first redelivery (the queues the source
// declares have no dead-letter exchange), and every unacked message is
// redelivered after a lost connection, a restart or a shutdown. The test
// node is RabbitMQ 3: Open refuses such arguments, for the queue and for
// the dead-letter queue (each read of the dead letters by once dlq is a
// delivery), naming the field, and declares nothing. Before, Open declared
// the queue and every message put back was lost.
func TestDeliveryLimitBelowOneRefusedBeforeRabbitMQ4(t *testing.T) {
	a := newAdmin(t)
	if v, _ := a.conn.Properties["version"].(string); v == "" || v[0] != '3' {
		t.Skipf("the broker is RabbitMQ %q: the rule is RabbitMQ 3's", v)
	}
	for _, tc := range []struct {
		name  string
		edit  func(c *amqp.Config)
		field string
	}{
		{"queue -1", func(c *amqp.Config) { c.QueueArgs = amqp091.Table{"x-delivery-limit": int64(-1)} }, "Config.QueueArgs"},
		{"queue 0", func(c *amqp.Config) { c.QueueArgs = amqp091.Table{"x-delivery-limit": int32(0)} }, "Config.QueueArgs"},
		{"dead-letter queue -1", func(c *amqp.Config) {
			c.DeadLetter.QueueArgs = amqp091.Table{"x-delivery-limit": -1}
		}, "Config.DeadLetter.QueueArgs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := queueName(t)
			a.cleanupQueue(q)
			cfg := amqp.Config{URL: brokerURL(t), Queue: q, QueueType: amqp.QueueQuorum, Logger: testLogger(t)}
			tc.edit(&cfg)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			src, err := amqp.Open(ctx, cfg)
			if err == nil {
				_ = src.Close()
			}
			require.Error(t, err)
			assert.NotErrorIs(t, err, context.DeadlineExceeded, "refused at once, not retried")
			assert.Contains(t, err.Error(), tc.field)
			assert.Contains(t, err.Error(), "x-delivery-limit")
			_, err = a.ready(q)
			require.Error(t, err, "the queue was not declared")
		})
	}
	// A limit of 1 or more is the operator's (with a dead-letter exchange
	// of their own); classic queues have none.
	q := queueName(t)
	a.cleanupQueue(q)
	openSource(t, amqp.Config{Queue: q, QueueType: amqp.QueueQuorum, QueueArgs: amqp091.Table{"x-delivery-limit": int64(5)}})
}

// TestDeliveryLimitRuleFollowsTheBrokersVersion: RabbitMQ 4 and later
// take -1 for no limit (and have a limit of 20 without it).
func TestDeliveryLimitRuleFollowsTheBrokersVersion(t *testing.T) {
	args := amqp091.Table{"x-delivery-limit": int64(-1)}
	for v, refused := range map[string]bool{"3.10.8": true, "3.13.7": true, "4.0.5": false, "4.1.0": false, "": false, "garbage": false} {
		err := amqp.CheckDeliveryLimit("Config.QueueArgs", args, v)
		assert.Equal(t, refused, err != nil, "%q: %v", v, err)
	}
	assert.NoError(t, amqp.CheckDeliveryLimit("Config.QueueArgs", amqp091.Table{"x-delivery-limit": int64(1)}, "3.10.8"))
	assert.NoError(t, amqp.CheckDeliveryLimit("Config.QueueArgs", nil, "3.10.8"))
}
