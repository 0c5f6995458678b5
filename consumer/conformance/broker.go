package conformance

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/consumer"
)

// Features says what an adapter can and cannot do, so the suite runs only
// the tests that apply.
type Features struct {
	// Ordered: deliveries of one stream (Kafka partition) arrive in publish
	// order and carry a non-empty Message.Stream. Messages published with
	// the same OutMessage.Key land on the same stream.
	Ordered bool
	// FallbackID: the adapter derives Message.FallbackID for messages
	// without an id (Kafka: topic/partition/offset), the same on every
	// delivery of a message.
	FallbackID bool
	// RedeliverOnRestart: deliveries that were received but never acked are
	// delivered again to the next Source opened on the same subscription,
	// so that the consumer can suspect them of a crash: an ordered adapter's
	// new Source gives its deliveries a new Delivery.Context, an unordered
	// one marks them with Message.Redelivered or DeliveryCount
	// (StallLoopDeadLettered).
	RedeliverOnRestart bool
}

// OutMessage is a message the suite asks the broker to publish.
type OutMessage struct {
	// ID is the event id, written where the adapter reads ids from (Kafka:
	// the "id" header; AMQP: the message-id property). Empty: no id.
	ID string
	// Type is the event type, written where the adapter reads types from
	// (the "type" header, or AMQP's type property). Empty: no type.
	Type    string
	Key     []byte
	Value   []byte
	Headers map[string]string
}

// DeadLetterRecord is a message read back from the adapter's dead-letter
// destination.
type DeadLetterRecord struct {
	Key     []byte
	Value   []byte
	Headers map[string]string
}

// Broker is what an adapter's test provides to the suite: one fresh
// subscription (topic and group, or queue) per call of the factory, so that
// tests are independent.
type Broker interface {
	// Publish sends msgs to the subscription, in order, and returns once the
	// broker has them.
	Publish(ctx context.Context, msgs ...OutMessage) error
	// NewSource opens a new Source on the subscription; calling it again
	// after closing the previous one is a restart of the consumer. The
	// suite closes every Source through the consumer.
	NewSource(t *testing.T) consumer.Source
	// DeadLetters returns every record in the dead-letter destination so
	// far, in the order they were written.
	DeadLetters(ctx context.Context) ([]DeadLetterRecord, error)
}

// Suite is what an adapter's test passes to Run.
type Suite struct {
	Features Features
	// NewBroker returns a fresh subscription for one test.
	NewBroker func(t *testing.T) Broker
	// NewDB returns a pool on a real PostgreSQL database whose search_path
	// is an empty schema of this test's own, as oncetest.Postgres(t) does.
	NewDB func(t *testing.T) *pgxpool.Pool
	// Tune, when set, adjusts the consumer configuration of every test,
	// e.g. to run the suite with Batch.Size 1 as well as batched.
	Tune func(*consumer.Config)
}
