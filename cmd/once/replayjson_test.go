package main

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// dlq replay -json printed each replayed record whole in its outcome, its
// key and payload in base64: the report of a replay of thousands of large
// dead letters was gigabytes on stdout, a copy of the destination that
// nobody asked for (the report without -json shows refs and ids). An
// outcome says which record it was (ref, position, ids, headers) and what
// was done, without the key and payload.
func TestReplayJSONLeavesThePayloadsOut(t *testing.T) {
	k := testenv.NewKafka(t)
	orig := testenv.Uniq("orders")
	k.CreateTopic(orig, 1)
	name := orig + ".dlq"
	k.CreateTopic(name, 1)
	payload := bytes.Repeat([]byte("p"), 256<<10)
	k.Produce(&sarama.ProducerMessage{Topic: name, Key: sarama.StringEncoder("the-key"), Value: sarama.ByteEncoder(payload),
		Headers: []sarama.RecordHeader{
			{Key: []byte(consumer.HeaderEventID), Value: []byte("e-1")},
			{Key: []byte(consumer.HeaderConsumer), Value: []byte("billing")},
			{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
			{Key: []byte(consumer.HeaderOriginalTopic), Value: []byte(orig)},
		}})
	env := map[string]string{"ONCE_KAFKA_BROKERS": strings.Join(k.Addrs, ",")}

	for _, dry := range []bool{true, false} {
		args := []string{"dlq", "replay", "-dlq", name, "-all", "-json"}
		if dry {
			args = append(args, "-dry-run")
		}
		code, out, errOut := cli(t, env, args...)
		require.Equal(t, exitOK, code, errOut)
		assert.Less(t, len(out), 4<<10, "dry run %v: the report is %d bytes", dry, len(out))
		assert.NotContains(t, out, base64.StdEncoding.EncodeToString(payload[:3<<10]), "dry run %v: the payload", dry)
		var rep struct {
			dlq.Report
			Outcomes []struct {
				Result string `json:"result"`
				Record struct {
					Ref      string          `json:"ref"`
					Position int             `json:"position"`
					EventID  string          `json:"event_id"`
					Key      json.RawMessage `json:"key"`
					Value    json.RawMessage `json:"value"`
				} `json:"record"`
			} `json:"outcomes"`
		}
		require.NoError(t, json.Unmarshal([]byte(out), &rep), "%s", out)
		require.Len(t, rep.Outcomes, 1, "%s", out)
		o := rep.Outcomes[0]
		assert.Equal(t, "0:0", o.Record.Ref)
		assert.Equal(t, 1, o.Record.Position)
		assert.Equal(t, "e-1", o.Record.EventID)
		assert.Nil(t, o.Record.Key, "no key")
		assert.Nil(t, o.Record.Value, "no payload")
		if dry {
			assert.Equal(t, dlq.WouldReplay, o.Result)
		} else {
			assert.Equal(t, dlq.Replayed, o.Result)
			assert.Equal(t, 1, rep.Replayed)
		}
	}
}

// dlq list -json (and a replay's outcomes) gave the event type, the
// error, the consumer and the kind with U+FFFD for each byte that is not
// UTF-8, and no hex of their bytes, as it gave the event id's
// (event_id_hex): an error quoting a payload's bytes, or a type header of
// another producer, lost them. Each has its _hex twin.
func TestListJSONKeepsSummaryFieldsThatAreNotUTF8(t *testing.T) {
	r := &dlq.Record{Ref: "0:1", Value: []byte("{}"), Headers: []dlq.Header{
		{Key: consumer.HeaderEventID, Value: "e-1"},
		{Key: consumer.HeaderEventType, Value: "t-\xff"},
		{Key: consumer.HeaderErrorMessage, Value: "bad byte \xfe"},
		{Key: consumer.HeaderConsumer, Value: "c-\xfd"},
		{Key: consumer.HeaderErrorKind, Value: "k-\xfc"},
	}}
	b, err := json.Marshal(summarize(r))
	require.NoError(t, err)
	var got map[string]any
	require.NoError(t, json.Unmarshal(b, &got), "%s", b)
	assert.Equal(t, "742dff", got["event_type_hex"], "%s", b)
	assert.Equal(t, "626164206279746520fe", got["error_hex"], "%s", b)
	assert.Equal(t, "632dfd", got["consumer_hex"], "%s", b)
	assert.Equal(t, "6b2dfc", got["kind_hex"], "%s", b)
	assert.NotContains(t, got, "event_id_hex", "an id that is text has no hex")

	b, err = json.Marshal(summarize(&dlq.Record{Ref: "0:2", Headers: []dlq.Header{
		{Key: consumer.HeaderEventType, Value: "t"}, {Key: consumer.HeaderErrorMessage, Value: "e"},
		{Key: consumer.HeaderConsumer, Value: "c"}, {Key: consumer.HeaderErrorKind, Value: "handler"},
	}}))
	require.NoError(t, err)
	assert.NotContains(t, string(b), "_hex", "text has no hex")
}
