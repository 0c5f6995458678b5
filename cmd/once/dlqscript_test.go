package main

import (
	"bytes"
	"encoding/hex"
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

// A replay whose selection matches no record exits 4, as dlq show does,
// and still prints its report: it exited 0, and a script could not tell
// a misspelt -id (or records replayed and removed meanwhile) from a
// replay that redrove what it asked for. So does -all on an empty
// destination, and a dry run. A replay that selects something exits 0.
func TestReplayOfNothingExitsNotFound(t *testing.T) {
	k := testenv.NewKafka(t)
	orig := testenv.Uniq("orders")
	k.CreateTopic(orig, 1)
	name := orig + ".dlq"
	k.CreateTopic(name, 1)
	empty := testenv.Uniq("empty") + ".dlq"
	k.CreateTopic(empty, 1)
	k.Produce(&sarama.ProducerMessage{Topic: name, Value: sarama.StringEncoder("{}"), Headers: []sarama.RecordHeader{
		{Key: []byte(consumer.HeaderEventID), Value: []byte("e-1")},
		{Key: []byte(consumer.HeaderConsumer), Value: []byte("billing")},
		{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
		{Key: []byte(consumer.HeaderOriginalTopic), Value: []byte(orig)},
	}})
	env := map[string]string{"ONCE_KAFKA_BROKERS": strings.Join(k.Addrs, ",")}

	for _, args := range [][]string{
		{"-dlq", name, "-id", "e-2"},
		{"-dlq", name, "-id", "e-2", "-dry-run"},
		{"-dlq", empty, "-all"},
	} {
		code, out, errOut := cli(t, env, append([]string{"dlq", "replay"}, args...)...)
		assert.Equal(t, exitNotFound, code, "%v: %s%s", args, out, errOut)
		assert.Contains(t, out, ": 0 selected, ", "%v: the report is printed", args)
		assert.Contains(t, errOut, "no record in kafka topic ", "%v", args)
	}
	code, out, errOut := cli(t, env, "dlq", "replay", "-dlq", name, "-id", "e-2", "-json")
	assert.Equal(t, exitNotFound, code, errOut)
	var rep dlq.Report
	require.NoError(t, json.Unmarshal([]byte(out), &rep), "-json prints the report")
	assert.Zero(t, rep.Selected)

	code, out, errOut = cli(t, env, "dlq", "replay", "-dlq", name, "-id", "e-1")
	assert.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, ": 1 selected, replayed 1, skipped 0\n")
}

// dlq show prints the first 32 KiB of a payload, saying how long it is
// and how to print it all: it printed every byte, and a dead letter of a
// hundred megabytes (four hundred as a hex dump) flooded the terminal.
// -payload-all and -json print every byte.
func TestShowCutsAHugePayload(t *testing.T) {
	k := testenv.NewKafka(t)
	name := testenv.Uniq("orders") + ".dlq"
	k.CreateTopic(name, 1)
	const size = 512 << 10
	text := strings.Repeat("é", size/2) // 2 bytes a character
	binary := bytes.Repeat([]byte{0xff, 0x00}, size/2)
	for i, v := range [][]byte{[]byte(text), binary, []byte(`{"small":true}`)} {
		k.Produce(&sarama.ProducerMessage{Topic: name, Value: sarama.ByteEncoder(v), Headers: []sarama.RecordHeader{
			{Key: []byte(consumer.HeaderEventID), Value: []byte("e-" + string(rune('1'+i)))},
		}})
	}
	env := map[string]string{"ONCE_KAFKA_BROKERS": strings.Join(k.Addrs, ",")}
	const mark = "… cut: the first 32,768 of its 524,288 bytes are shown (-payload-all or -json prints them all)\n"

	code, out, errOut := cli(t, env, "dlq", "show", "-dlq", name, "-ref", "0:0")
	require.Equal(t, exitOK, code, errOut)
	assert.Less(t, len(out), 40<<10, "text: the output is %d bytes", len(out))
	assert.True(t, strings.HasSuffix(out, "\npayload (524288 bytes, text):\n"+text[:32<<10]+"\n"+mark),
		"the payload's first 32 KiB, and the mark")

	code, out, errOut = cli(t, env, "dlq", "show", "-dlq", name, "-ref", "0:1")
	require.Equal(t, exitOK, code, errOut)
	assert.Less(t, len(out), 160<<10, "hex: the output is %d bytes", len(out))
	assert.True(t, strings.HasSuffix(out, "\npayload (524288 bytes, hex):\n"+hex.Dump(binary[:32<<10])+mark),
		"the hex dump of the payload's first 32 KiB, and the mark")

	code, out, errOut = cli(t, env, "dlq", "show", "-dlq", name, "-ref", "0:2")
	require.Equal(t, exitOK, code, errOut)
	assert.True(t, strings.HasSuffix(out, "\npayload (14 bytes, text):\n{\"small\":true}\n"), "a short payload is printed whole, unmarked: %q", out)

	code, out, errOut = cli(t, env, "dlq", "show", "-dlq", name, "-ref", "0:0", "-payload-all")
	require.Equal(t, exitOK, code, errOut)
	assert.True(t, strings.HasSuffix(out, "\npayload (524288 bytes, text):\n"+text+"\n"), "-payload-all prints every byte")
	code, out, errOut = cli(t, env, "dlq", "show", "-dlq", name, "-ref", "0:0", "-json")
	require.Equal(t, exitOK, code, errOut)
	var got []struct {
		Value string `json:"value"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &got))
	require.Len(t, got, 1)
	assert.True(t, got[0].Value == text, "-json prints every byte")
}

// once status prints the row of the pairs its tally does not keep
// (dlq.TallyGroups) as "(others)", not as "-", which reads as records
// without a consumer or kind.
func TestStatusNamesTheOthersRow(t *testing.T) {
	var out bytes.Buffer
	a := newApp(&out, &out, func(string) string { return "" })
	a.printStatus(statusReport{DLQ: "kafka topic orders.dlq", DeadLetters: []dlq.KindCount{
		{Consumer: "billing", Kind: "handler", Count: 3}, {Others: true, Count: 2},
	}})
	assert.Contains(t, out.String(), "\ndead letters in kafka topic orders.dlq:\n"+
		"CONSUMER  KIND      COUNT  REPLAYABLE  LAST\n"+
		"billing   handler   3      0           -\n"+
		"(others)  (others)  2      0           -\n")
}
