package dlq_test

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// A consumer that keeps its Kafka offsets in PostgreSQL dead-letters a
// record whose envelope it could not open, before the record had an id:
// the redrive carries no once-redrive-event-id, and the copy is identified
// by its first position, which the consumer recorded done when it
// dead-lettered it. That position must not make its own copy a duplicate:
// the copy is handled, once.
func TestKafkaReplayOfAnOwnDeadLetterWithoutIDOnOffsetsInTheDatabaseIsHandled(t *testing.T) {
	k := testenv.NewKafka(t)
	topic := testenv.Uniq("orders")
	k.CreateTopic(topic, 1)
	k.CreateTopic(topic+".dlq", 1)
	pool, _ := pgtest.Schema(t)
	var broken atomic.Bool
	broken.Store(true)
	inDatabase := func(c *kafka.Config) { c.OffsetsInDatabase = true }
	svc := testenv.StartService(t, pool, k.Source(testenv.Uniq("billing"), topic, inDatabase), "billing",
		func(c *consumer.Config) { c.Envelope = legacyEnvelope{&broken} })
	b, err := json.Marshal(map[string]any{"id": "", "data": testenv.Payload{N: 1, Mode: "ok"}}) // no id in the envelope
	require.NoError(t, err)
	k.Produce(kmsg(topic, 0, "", append([]byte(testenv.LegacyPrefix), b...)), kmsg(topic, 0, "", b)) // offsets 0 and 1
	svc.WaitSettled(t, 2)
	require.EqualValues(t, 1, svc.C.Stats().DeadLettered)
	broken.Store(false)

	replayOneTwice(t, k, topic, 2, svc)
	assert.Equal(t, map[string]int{topic + "/0/0": 1, topic + "/0/1": 1}, svc.Effects(t),
		"the redrive of its own dead letter is handled once, though its first position is done")
}

// replayOneTwice replays the one dead letter of billing in topic's
// dead-letter topic twice, waiting after each replay until svc has settled
// the copy (settled deliveries before the first).
func replayOneTwice(t *testing.T, k *testenv.Kafka, topic string, settled uint64, svc *testenv.Service) {
	t.Helper()
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: topic + ".dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for round := 1; round <= 2; round++ {
		rep, err := q.Replay(ctx, dlq.Filter{Consumer: "billing"}, dlq.ReplayOptions{})
		require.NoError(t, err)
		require.Equal(t, 1, rep.Replayed, "round %d: %+v", round, rep)
		svc.WaitSettled(t, settled+uint64(round))
	}
}
