package main

import (
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// handmadeDLQ is a dead-letter topic on kfake holding, in order, one
// record per id with the consumer beside it ("" writes no once-consumer
// header: another producer's record), each failed a minute ago and
// pointing back at orders; and the environment that reaches it.
func handmadeDLQ(t *testing.T, recs ...[2]string) (env map[string]string, dlqName string) {
	t.Helper()
	k := testenv.NewKafka(t)
	dlqName = testenv.Uniq("orders") + ".dlq"
	k.CreateTopic(dlqName, 1)
	failedAt := time.Now().Add(-time.Minute).UTC().Format(time.RFC3339Nano)
	for _, r := range recs {
		hs := []sarama.RecordHeader{
			{Key: []byte(consumer.HeaderEventID), Value: []byte(r[0])},
			{Key: []byte(consumer.HeaderErrorKind), Value: []byte(consumer.KindHandler)},
			{Key: []byte(consumer.HeaderFailedAt), Value: []byte(failedAt)},
			{Key: []byte(consumer.HeaderOriginalTopic), Value: []byte("orders")},
		}
		if r[1] != "" {
			hs = append(hs, sarama.RecordHeader{Key: []byte(consumer.HeaderConsumer), Value: []byte(r[1])})
		}
		k.Produce(&sarama.ProducerMessage{Topic: dlqName, Value: sarama.StringEncoder(`{}`), Headers: hs})
	}
	return map[string]string{"ONCE_KAFKA_BROKERS": strings.Join(k.Addrs, ",")}, dlqName
}

// An -id ending in * is a prefix: an event id that itself ends in a star
// ("sku*", as some producers write a wildcard product) could not be
// selected alone, only with every id it starts. A backslash before the
// final star makes it part of the id.
func TestIDEndingInAStarIsSelectedExactly(t *testing.T) {
	env, dlqName := handmadeDLQ(t, [2]string{"sku*", "billing"}, [2]string{"sku*-2", "billing"}, [2]string{"sku-3", "billing"})

	code, out, errOut := cli(t, env, "dlq", "list", "-dlq", dlqName, "-id", `sku\*`)
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "1 of 3 records in kafka topic "+dlqName+" match", "the id sku* alone")
	code, out, errOut = cli(t, env, "dlq", "show", "-dlq", dlqName, "-id", `sku\*`)
	require.Equal(t, exitOK, code, errOut)
	assert.Regexp(t, `(?m)^ref\s+0:0$`, out)
	assert.NotContains(t, out, "sku*-2")

	// The star unescaped is still a prefix, and a doubled backslash is
	// one backslash of a prefix.
	code, out, errOut = cli(t, env, "dlq", "list", "-dlq", dlqName, "-id", "sku*")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "3 of 3 records in kafka topic "+dlqName+" match")
	code, out, errOut = cli(t, env, "dlq", "list", "-dlq", dlqName, "-id", "sku\\*-*")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "0 of 3 records", "a backslash inside the pattern is the id's own")
	code, _, _ = cli(t, env, "dlq", "show", "-dlq", dlqName, "-id", `sku\\*`)
	assert.Equal(t, exitNotFound, code, `sku\\* is the prefix sku\, which no id has`)
}

// -until at or after now cannot narrow the selection (every record
// dead-lettered so far is before it), yet counted as a filter: a replay
// given it alone redrove the whole destination without -all. It is
// refused, as -id '*' is.
func TestUntilNotInThePastIsRefused(t *testing.T) {
	env, dlqName := handmadeDLQ(t, [2]string{"pay-1", "billing"}, [2]string{"pay-2", "billing"})

	for _, until := range []string{"2100-01-01", "0s", time.Now().Add(time.Hour).UTC().Format(time.RFC3339)} {
		code, out, errOut := cli(t, env, "dlq", "replay", "-dlq", dlqName, "-until", until, "-dry-run")
		assert.Equal(t, exitUsage, code, "-until %s: %s%s", until, out, errOut)
		assert.NotContains(t, out, "would replay", "-until %s", until)
		assert.Contains(t, errOut, "is not in the past", "-until %s", until)
		code, _, errOut = cli(t, env, "dlq", "list", "-dlq", dlqName, "-since", "1h", "-until", until)
		assert.Equal(t, exitUsage, code, "-until %s: %s", until, errOut)
	}
	// A bound in the past still selects.
	code, out, errOut := cli(t, env, "dlq", "list", "-dlq", dlqName, "-until", "2000-01-01")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "0 of 2 records in kafka topic "+dlqName+" match")
}

// A consumer named "-" was printed as "-", which stands for no consumer:
// its dead letters read as another producer's; and in once status one
// named "(others)" read as the row of the pairs past the tally's bound.
func TestConsumerNamedDashIsNotNoConsumer(t *testing.T) {
	env, dlqName := handmadeDLQ(t, [2]string{"pay-1", "-"}, [2]string{"pay-2", ""}, [2]string{"pay-3", "(others)"})
	_, schema := pgtest.Schema(t)
	env["DATABASE_URL"] = testenv.SchemaURL(schema)
	code, _, errOut := cli(t, env, "migrate")
	require.Equal(t, exitOK, code, errOut)
	code, out, errOut := cli(t, env, "status", "-dlq", dlqName)
	require.Equal(t, exitOK, code, errOut)
	assert.Regexp(t, `(?m)^"-"\s+handler\s+1\s`, out, "the consumer named -")
	assert.Regexp(t, `(?m)^-\s+handler\s+1\s`, out, "no consumer")
	assert.Regexp(t, `(?m)^"\(others\)"\s+handler\s+1\s`, out, "the consumer named (others)")

	code, out, errOut = cli(t, env, "dlq", "list", "-dlq", dlqName)
	require.Equal(t, exitOK, code, errOut)
	lines := strings.Split(out, "\n")
	require.GreaterOrEqual(t, len(lines), 3, out)
	assert.Regexp(t, `^0:0\s+\S+ \S+ UTC\s+"-"\s+handler\s+pay-1\s`, lines[1], "the consumer named -")
	assert.Regexp(t, `^0:1\s+\S+ \S+ UTC\s+-\s+handler\s+pay-2\s`, lines[2], "no consumer")

	code, out, errOut = cli(t, env, "dlq", "show", "-dlq", dlqName, "-id", "pay-1")
	require.Equal(t, exitOK, code, errOut)
	assert.Regexp(t, `(?m)^consumer\s+"-"$`, out)
	code, out, errOut = cli(t, env, "dlq", "show", "-dlq", dlqName, "-id", "pay-2")
	require.Equal(t, exitOK, code, errOut)
	assert.Regexp(t, `(?m)^consumer\s+-$`, out)
}

// A malformed ONCE_KAFKA_TLS is a Kafka setting: a command on RabbitMQ
// does not read it (a guard: it never failed them).
func TestMalformedKafkaTLSDoesNotFailRabbitMQCommands(t *testing.T) {
	env := map[string]string{"ONCE_KAFKA_TLS": "yes", "ONCE_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/"}
	for _, cmd := range [][]string{{"dlq", "list"}, {"dlq", "show", "-id", "x"}, {"dlq", "replay", "-all"}} {
		code, _, errOut := cli(t, env, append(cmd, "-dlq", "orders.dlq")...)
		assert.Equal(t, exitFailure, code, "%v: %s", cmd, errOut)
		assert.NotContains(t, errOut, "ONCE_KAFKA_TLS", cmd)
		assert.Contains(t, errOut, "connection refused", cmd)
	}
	code, _, errOut := cli(t, env, "dlq", "list", "-dlq", "orders.dlq", "-kafka", "127.0.0.1:1")
	assert.Equal(t, exitUsage, code, errOut)
	assert.Contains(t, errOut, "env ONCE_KAFKA_TLS=yes: want true or false", "a Kafka command reads it")
}
