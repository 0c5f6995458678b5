package amqp_test

import (
	"context"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/conformance"
	"github.com/onceco/once/internal/pgtest"
)

// rabbitBroker is one fresh queue (and its dead-letter queue) per test.
type rabbitBroker struct {
	a     *admin
	queue string
	typ   amqp.QueueType

	mu   sync.Mutex
	dead []conformance.DeadLetterRecord
}

func (b *rabbitBroker) Publish(ctx context.Context, msgs ...conformance.OutMessage) error {
	pubs := make([]amqp091.Publishing, len(msgs))
	for i, m := range msgs {
		h := amqp091.Table{}
		for k, v := range m.Headers {
			h[k] = v
		}
		pubs[i] = amqp091.Publishing{MessageId: m.ID, Type: m.Type, Headers: h, ContentType: "application/json", Body: m.Value}
	}
	return b.a.publish("", b.queue, pubs...)
}

func (b *rabbitBroker) NewSource(t *testing.T) consumer.Source {
	return openSource(t, amqp.Config{Queue: b.queue, QueueType: b.typ})
}

// DeadLetters takes the new records of the dead-letter queue with
// basic.get and returns them after the ones taken before.
func (b *rabbitBroker) DeadLetters(ctx context.Context) ([]conformance.DeadLetterRecord, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	got, err := b.a.getAll(b.queue + amqp.DeadLetterQueueSuffix)
	if err != nil {
		return nil, err
	}
	for _, d := range got {
		b.dead = append(b.dead, conformance.DeadLetterRecord{Value: d.Body, Headers: amqp.HeaderStrings(d.Headers)})
	}
	return append([]conformance.DeadLetterRecord(nil), b.dead...), nil
}

func runConformance(t *testing.T, typ amqp.QueueType) {
	brokerURL(t)
	conformance.Run(t, conformance.Suite{
		Features: conformance.Features{RedeliverOnRestart: true},
		NewBroker: func(t *testing.T) conformance.Broker {
			a := newAdmin(t)
			q := queueName(t)
			a.declare(q, typ) // before the suite publishes
			return &rabbitBroker{a: a, queue: q, typ: typ}
		},
		NewDB: func(t *testing.T) *pgxpool.Pool {
			pool, _ := pgtest.Schema(t)
			return pool
		},
	})
}

func TestConformanceClassic(t *testing.T) { runConformance(t, amqp.QueueClassic) }

func TestConformanceQuorum(t *testing.T) { runConformance(t, amqp.QueueQuorum) }
