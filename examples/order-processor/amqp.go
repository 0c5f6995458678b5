package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// amqpConfig is the source configuration: the queue o.topic and its
// dead-letter queue "<queue>.dlq", both durable classic queues that the
// source declares. Prefetch is a few times the consumer's Concurrency (16 by
// default) so that the workers never wait on the broker.
func amqpConfig(o *options, tel *telemetry, log *slog.Logger) amqp.Config {
	cfg := amqp.Config{
		URL:            o.amqpURL,
		Queue:          o.topic,
		Prefetch:       64,
		ConnectionName: "order-processor " + o.name,
		Logger:         log,
	}
	if tel != nil {
		cfg.MeterProvider = tel.MeterProvider()
	}
	return cfg
}

// amqpSource opens the consumer's source.
func amqpSource(ctx context.Context, o *options, tel *telemetry, log *slog.Logger) (consumer.Source, error) {
	return amqp.Open(ctx, amqpConfig(o, tel, log))
}

// prepareAMQP declares the queue and its dead-letter queue, and the second
// hop's (order.confirmed, shipping.go), durable classic
// queues as the source declares them, so that traffic published before the
// consumer starts is kept. It does not open a source: a source consumes, and
// the messages it took from a running service's queue would go back out of
// place.
func prepareAMQP(_ context.Context, o *options) error {
	conn, err := amqp091.Dial(o.amqpURL)
	if err != nil {
		return fmt.Errorf("RabbitMQ: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	for _, q := range append([]string{o.topic, o.topic + amqp.DeadLetterQueueSuffix}, shippingQueues(o)...) {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			return fmt.Errorf("RabbitMQ: declare queue %s: %w", q, err)
		}
	}
	return nil
}

// amqpPublisher publishes generated traffic to the queue through the default
// exchange, persistent, in confirm mode: the event id is the message-id
// property, the event type the type property.
type amqpPublisher struct {
	conn  *amqp091.Connection
	ch    *amqp091.Channel
	queue string
}

func newAMQPPublisher(_ context.Context, o *options) (*amqpPublisher, error) {
	conn, err := amqp091.Dial(o.amqpURL)
	if err != nil {
		return nil, fmt.Errorf("RabbitMQ: %w", err)
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		conn.Close()
		return nil, err
	}
	return &amqpPublisher{conn: conn, ch: ch, queue: o.topic}, nil
}

// Publish sends msgs in batches of 500 and returns once the broker
// confirmed every one.
func (p *amqpPublisher) Publish(ctx context.Context, msgs []outMsg) error {
	const batch = 500
	for len(msgs) > 0 {
		n := min(batch, len(msgs))
		confirms := make([]*amqp091.DeferredConfirmation, 0, n)
		for _, m := range msgs[:n] {
			c, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, "", p.queue, true, false, amqp091.Publishing{
				DeliveryMode: amqp091.Persistent,
				ContentType:  "application/json",
				MessageId:    m.ID,
				Type:         m.Type,
				Body:         m.Value,
				Timestamp:    time.Now(),
			})
			if err != nil {
				return err
			}
			confirms = append(confirms, c)
		}
		for _, c := range confirms {
			ok, err := c.WaitContext(ctx)
			if err != nil {
				return err
			}
			if !ok {
				return errors.New("RabbitMQ nacked a published message")
			}
		}
		msgs = msgs[n:]
	}
	return nil
}

// Close closes the publisher's connection.
func (p *amqpPublisher) Close() error { return p.conn.Close() }

// amqpQueues inspects and cleans up the demo's queues.
type amqpQueues struct {
	conn  *amqp091.Connection
	ch    *amqp091.Channel
	queue string
	taken []deadLetter // dead letters read so far
}

func newAMQPQueues(url, queue string) (*amqpQueues, error) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		conn.Close()
		return nil, err
	}
	return &amqpQueues{conn: conn, ch: ch, queue: queue}, nil
}

// Ready returns the messages of the queue waiting to be delivered (not
// counting those delivered and not yet acked) and its consumers.
func (q *amqpQueues) Ready() (messages, consumers int, err error) {
	st, err := q.ch.QueueDeclarePassive(q.queue, true, false, false, false, nil)
	if err != nil {
		return 0, 0, err
	}
	return st.Messages, st.Consumers, nil
}

// WaitNoConsumers waits until the queue has no consumer: the broker has
// noticed that the killed consumer's connection is gone and put its unacked
// messages back in the queue.
func (q *amqpQueues) WaitNoConsumers(ctx context.Context) error {
	deadline := time.After(30 * time.Second)
	for {
		_, n, err := q.Ready()
		if err != nil || n == 0 {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-deadline:
			return errors.New("RabbitMQ still lists the killed consumer after 30s")
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// DeadLetters takes the messages off the dead-letter queue and returns
// them with those taken by earlier calls.
func (q *amqpQueues) DeadLetters() ([]deadLetter, error) {
	for {
		d, ok, err := q.ch.Get(q.queue+amqp.DeadLetterQueueSuffix, true)
		if err != nil {
			return nil, err
		}
		if !ok {
			return q.taken, nil
		}
		h := map[string]string{}
		for k, v := range d.Headers {
			h[k] = fmt.Sprint(v)
		}
		q.taken = append(q.taken, deadLetter{Value: d.Body, Headers: h, ID: d.MessageId, Type: d.Type})
	}
}

// Delete removes the queue and its dead-letter queue.
func (q *amqpQueues) Delete() error {
	_, err1 := q.ch.QueueDelete(q.queue, false, false, false)
	_, err2 := q.ch.QueueDelete(q.queue+amqp.DeadLetterQueueSuffix, false, false, false)
	return errors.Join(err1, err2)
}

// Close closes the connection.
func (q *amqpQueues) Close() error { return q.conn.Close() }
