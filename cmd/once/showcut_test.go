package main

import (
	"bytes"
	"encoding/json"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// once dlq show prints a Kafka key, a header's name and a header's value of
// a megabyte cut to their first 4 KiB, as the console shows them, saying
// how many bytes there are and that -json prints them whole: printed
// whole, a few of them filled the terminal's scrollback and hid the
// record's other lines. So are the summary's lines taken from headers (the
// event type, the error). Short ones are printed whole, without the mark.
func TestShowCutsAHugeKeyOrHeader(t *testing.T) {
	const size = 1 << 20
	k := testenv.NewSecuredKafka(t, func() *sarama.Config {
		sc := testenv.Sarama()
		sc.Producer.MaxMessageBytes = 8 << 20
		return sc
	}, kfake.BrokerConfigs(map[string]string{"message.max.bytes": strconv.Itoa(8 << 20)}))
	name := testenv.Uniq("orders") + ".dlq"
	k.CreateTopic(name, 1)
	key := bytes.Repeat([]byte("customer-42/"), size/12+1)[:size]
	bigValue := strings.Repeat("v", size)
	bigName := "x-" + strings.Repeat("n", size-2)
	k.Produce(&sarama.ProducerMessage{Topic: name, Key: sarama.ByteEncoder(key), Value: sarama.StringEncoder("{}"),
		Headers: []sarama.RecordHeader{
			{Key: []byte(consumer.HeaderEventID), Value: []byte("ev-1")},
			{Key: []byte("x-big"), Value: []byte(bigValue)},
			{Key: []byte(bigName), Value: []byte("small")},
			{Key: []byte(consumer.HeaderEventType), Value: []byte(bigValue)},
			{Key: []byte(consumer.HeaderErrorMessage), Value: []byte(bigValue)},
		}})
	env := map[string]string{"ONCE_KAFKA_BROKERS": strings.Join(k.Addrs, ",")}

	code, out, errOut := cli(t, env, "dlq", "show", "-dlq", name, "-ref", "0:0")
	require.Equal(t, exitOK, code, errOut)
	assert.Less(t, len(out), 64<<10, "the output is %d bytes", len(out))
	cutMark := regexp.MustCompile(`… cut: the first 4,096 of its 1,048,576 bytes are shown \(-json prints them whole\)`)
	assert.Len(t, cutMark.FindAllString(out, -1), 7,
		"the key, three headers' values, a header's name, and the event type and error that the summary shows of two of them are marked cut")
	summary := out[:strings.Index(out, "\nheaders:")]
	assert.Equal(t, 2, strings.Count(summary, bigValue[:4096]+" … cut"), "the summary's event type and error are cut")
	assert.True(t, strings.Contains(summary, "\nevent type "), "the summary shows the event type")
	// (Contains in a bool: testify would print all of out.)
	assert.True(t, strings.Contains(out, "\nkey: "+string(key[:4096])+" … cut"), "the key's first 4 KiB are printed")
	assert.False(t, strings.Contains(out, string(key[:4097])), "only the key's first 4 KiB are printed")
	assert.True(t, strings.Contains(out, "\n  x-big: "+bigValue[:4096]+" … cut"), "the value's first 4 KiB are printed")
	assert.False(t, strings.Contains(out, bigValue[:4097]), "only the value's first 4 KiB are printed")
	assert.True(t, strings.Contains(out, "\n  "+bigName[:4096]+" … cut"), "the name's first 4 KiB are printed")
	assert.Contains(t, out, "  "+consumer.HeaderEventID+": ev-1\n", "a short header is printed whole")
	assert.Contains(t, out, ": small\n", "a short value is printed whole")

	code, out, errOut = cli(t, env, "dlq", "show", "-dlq", name, "-ref", "0:0", "-json")
	require.Equal(t, exitOK, code, errOut)
	var got []struct {
		Key     string `json:"key"`
		Headers []struct {
			Key   string `json:"key"`
			Value string `json:"value"`
		} `json:"headers"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &got))
	require.Len(t, got, 1)
	assert.Equal(t, string(key), got[0].Key, "-json prints the key whole")
	require.Len(t, got[0].Headers, 5)
	assert.Equal(t, bigValue, got[0].Headers[1].Value, "-json prints the value whole")
	assert.Equal(t, bigName, got[0].Headers[2].Key, "-json prints the name whole")
}
