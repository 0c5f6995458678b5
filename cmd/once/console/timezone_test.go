package console_test

import (
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// The pages show times in UTC. They said so nowhere: "20:30:00" in a
// browser reads as the reader's own time, hours off in most places (was
// it before or after this morning's deploy?). Each time says UTC.
func TestPagesSayTheirTimesAreUTC(t *testing.T) {
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 1)
	k.Produce(&sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.StringEncoder(`{}`),
		Headers: []sarama.RecordHeader{
			{Key: []byte(consumer.HeaderEventID), Value: []byte("pay-1")},
			{Key: []byte(consumer.HeaderConsumer), Value: []byte("billing")},
			{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
			{Key: []byte(consumer.HeaderFailedAt), Value: []byte("2026-11-29T21:30:00+01:00")},
		}})
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	h, err := console.New(console.Config{Queues: []dlq.Queue{q}, Logger: testenv.Logger()})
	require.NoError(t, err)
	for _, page := range []string{"/", "/dlq?q=0", "/record?q=0&ref=0:0"} {
		_, body := serve(t, h, page)
		assert.True(t, strings.Contains(body, "2026-11-29 20:30:00 UTC"), "%s: the time without its zone", page)
	}
}
