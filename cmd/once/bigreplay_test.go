package main

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/internal/pgtest"
)

// A dead letter over 1 MB, written whole by a consumer whose dead-letter
// producer's Producer.MaxMessageBytes was raised as docs/reliability.md
// says to (the topics and the broker take such records), is listed as
// replayable, but once dlq replay could not publish it: the redrive
// producer kept sarama's default Producer.MaxMessageBytes (1 MiB), which
// no flag of the command raises, so sarama refused the redrive before
// sending it ("Attempt to produce message larger than configured
// Producer.MaxMessageBytes"). The replay stopped there with exit 1, and
// every record selected after it was never replayed: one large dead letter
// blocked the redrive of the whole destination. The broker, which took the
// record once, is the judge of its size.
func TestReplayOfADeadLetterOverOneMegabyte(t *testing.T) {
	const limit = 4 << 20
	k := testenv.NewSecuredKafka(t, func() *sarama.Config {
		sc := testenv.Sarama()
		sc.Producer.MaxMessageBytes = limit // the test's producer and the consumer's dead-letter producer
		return sc
	}, kfake.BrokerConfigs(map[string]string{"message.max.bytes": strconv.Itoa(limit)}))
	topic := testenv.Uniq("orders")
	k.CreateTopic(topic, 1)
	k.CreateTopic(topic+".dlq", 1)
	pool, schema := pgtest.Schema(t)

	big, err := json.Marshal(map[string]any{"n": 1, "mode": "fail", "pad": strings.Repeat("x", 1_500_000)})
	require.NoError(t, err)
	msg := func(id string, v []byte) *sarama.ProducerMessage {
		return &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("key-" + id), Value: sarama.ByteEncoder(v),
			Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(id)}}}
	}
	k.Produce(msg("big-1", big), msg("fail-2", testenv.JSON(2, "fail")))
	svc := testenv.StartService(t, pool, k.Source(testenv.Uniq("g"), topic), "billing")
	svc.WaitSettled(t, 2)
	require.EqualValues(t, 2, svc.C.Stats().DeadLettered)
	svc.Broken.Store(false)
	env := map[string]string{"ONCE_KAFKA_BROKERS": strings.Join(k.Addrs, ","), "DATABASE_URL": testenv.SchemaURL(schema)}

	code, out, errOut := cli(t, env, "dlq", "list", "-dlq", topic+".dlq", "-id", "big-1", "-json")
	require.Equal(t, exitOK, code, errOut)
	var listed []recordSummary
	require.NoError(t, json.Unmarshal([]byte(out), &listed))
	require.Len(t, listed, 1)
	require.True(t, listed[0].Replayable, "the big dead letter is written whole and listed as replayable")

	code, out, errOut = cli(t, env, "dlq", "replay", "-dlq", topic+".dlq", "-all")
	require.Equal(t, exitOK, code, "stdout: %s\nstderr: %s", out, errOut)
	assert.Contains(t, out, "replayed 2")
	svc.WaitSettled(t, 4)
	effects := svc.Effects(t)
	assert.Equal(t, 1, effects["big-1"], "the big dead letter is redriven and handled")
	assert.Equal(t, 1, effects["fail-2"], "the dead letter after it is redriven too")
}
