package main

import (
	"context"
	"io"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// dlq list, dlq show and status over a large dead-letter topic hold the
// records they print, not every record of the topic with its payload:
// list keeps its -limit of summaries, show its -limit of records, status
// counts and keeps none.
func TestCommandsDoNotHoldEveryRecordOfALargeTopic(t *testing.T) {
	k := testenv.NewKafka(t)
	topic := testenv.Uniq("orders") + ".dlq"
	k.CreateTopic(topic, 1)
	const n = 60
	var msgs []*sarama.ProducerMessage
	for i := range n {
		msgs = append(msgs, &sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(make([]byte, 4096)),
			Headers: []sarama.RecordHeader{
				{Key: []byte(consumer.HeaderEventID), Value: []byte("e-" + strconv.Itoa(i))},
				{Key: []byte(consumer.HeaderConsumer), Value: []byte("billing")},
				{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
			}})
	}
	k.Produce(msgs...)
	pool, schema := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background(), pool))
	env := map[string]string{"ONCE_KAFKA_BROKERS": strings.Join(k.Addrs, ","), "DATABASE_URL": testenv.SchemaURL(schema)}

	var kept atomic.Int64
	run := func(args ...string) string {
		t.Helper()
		var out strings.Builder
		a := newApp(&out, io.Discard, func(k string) string { return env[k] })
		a.wrapQueue = func(q dlq.Queue) dlq.Queue { return testenv.KeepingQueue{Queue: q, Kept: &kept} }
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		require.Equal(t, exitOK, a.run(ctx, args), "%v", args)
		return out.String()
	}
	assert.Contains(t, run("dlq", "list", "-dlq", topic, "-limit", "5"), "5 of 60 records shown")
	assert.LessOrEqual(t, kept.Load(), int64(5), "dlq list held every record it read")
	run("dlq", "list", "-dlq", topic, "-limit", "5", "-json")
	assert.LessOrEqual(t, kept.Load(), int64(5), "dlq list -json held every record it read")
	run("dlq", "show", "-dlq", topic, "-consumer", "billing", "-limit", "2")
	assert.LessOrEqual(t, kept.Load(), int64(2), "dlq show held every record it read")
	assert.Contains(t, run("status", "-dlq", topic), "60")
	assert.Zero(t, kept.Load(), "status held every record it read")
}
