package amqp_test

import (
	"context"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/conformance"
	"github.com/onceco/once/internal/pgtest"
)

// rabbitBroker is one fresh queue (and its dead-letter queue) per test.
// With an exchange, messages are published there with OutMessage.Key as
// routing key, and the queue is bound to it with "#".
type rabbitBroker struct {
	a        *admin
	queue    string
	typ      amqp.QueueType
	exchange string
	ordered  bool

	mu   sync.Mutex
	dead []conformance.DeadLetterRecord
}

func (b *rabbitBroker) Publish(ctx context.Context, msgs ...conformance.OutMessage) error {
	for _, m := range msgs {
		h := amqp091.Table{}
		for k, v := range m.Headers {
			h[k] = v
		}
		p := amqp091.Publishing{MessageId: m.ID, Type: m.Type, Headers: h, ContentType: "application/json", Body: m.Value}
		exchange, key := "", b.queue
		if b.exchange != "" {
			exchange, key = b.exchange, string(m.Key)
		}
		if err := b.a.publish(exchange, key, p); err != nil {
			return err
		}
	}
	return nil
}

func (b *rabbitBroker) NewSource(t *testing.T) consumer.Source {
	cfg := amqp.Config{Queue: b.queue, QueueType: b.typ, Ordered: b.ordered}
	if b.exchange != "" {
		cfg.Exchanges = []amqp.Exchange{{Name: b.exchange, Kind: "topic"}}
		cfg.Bindings = []amqp.Binding{{Exchange: b.exchange, RoutingKey: "#"}}
	}
	return openSource(t, cfg)
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
		b.dead = append(b.dead, conformance.DeadLetterRecord{Key: []byte(amqp.HeaderStrings(d.Headers)[amqp.HeaderOriginalRoutingKey]), Value: d.Body, Headers: amqp.HeaderStrings(d.Headers)})
	}
	return append([]conformance.DeadLetterRecord(nil), b.dead...), nil
}

func runConformance(t *testing.T, typ amqp.QueueType, ordered bool) {
	brokerURL(t)
	conformance.Run(t, conformance.Suite{
		Features: conformance.Features{RedeliverOnRestart: true, Ordered: ordered},
		NewBroker: func(t *testing.T) conformance.Broker {
			a := newAdmin(t)
			q := queueName(t)
			a.declare(q, typ) // before the suite publishes
			b := &rabbitBroker{a: a, queue: q, typ: typ, ordered: ordered}
			if ordered {
				b.exchange = q + ".x"
				ch, err := a.channel()
				require.NoError(t, err)
				require.NoError(t, ch.ExchangeDeclare(b.exchange, "topic", true, false, false, false, nil))
				require.NoError(t, ch.QueueBind(q, "#", b.exchange, false, nil))
				t.Cleanup(func() {
					if ch, err := a.channel(); err == nil {
						_ = ch.ExchangeDelete(b.exchange, false, false)
					}
				})
			}
			return b
		},
		NewDB: func(t *testing.T) *pgxpool.Pool {
			pool, _ := pgtest.Schema(t)
			return pool
		},
	})
}

func TestConformanceClassic(t *testing.T) { runConformance(t, amqp.QueueClassic, false) }

func TestConformanceQuorum(t *testing.T) { runConformance(t, amqp.QueueQuorum, false) }

// TestConformanceOrdered runs the suite with Config.Ordered, publishing
// through a topic exchange whose routing keys are the suite's keys.
func TestConformanceOrdered(t *testing.T) { runConformance(t, amqp.QueueClassic, true) }
