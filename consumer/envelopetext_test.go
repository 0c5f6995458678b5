package consumer_test

import (
	"crypto/sha256"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// encoding/json decodes a JSON string holding bytes that are not UTF-8, or
// an escaped lone surrogate (\ud83d, as JavaScript writes a string cut in
// the middle of an emoji), with U+FFFD in their place, without an error:
// JSONEnvelope took such an id for another one, "o-\ufffd", so that two
// events whose ids differ there were claimed under one id. Under a
// fingerprint of the data alone (what a CloudEvents service uses, so that
// a producer's re-send with a new time attribute is a duplicate) the
// second was skipped as a duplicate, its effect lost; under the default
// one it was dead-lettered as an id conflict. An id in an envelope that
// is not text is dead-lettered as undecodable, as one in a header is as
// invalid; a U+FFFD the producer wrote itself is text.
func TestJSONEnvelopeIDThatIsNotTextIsNotTakenForAnother(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for _, v := range []string{
		`{"id":"o-\ud83d","type":"t","data":{"n":1}}`,
		`{"id":"o-\ud83e","type":"t","data":{"n":1}}`,
		"{\"id\":\"o-\xff\",\"type\":\"t\",\"data\":{\"n\":1}}",
		`{"id":"u-\ufffd","type":"t","data":{"n":2}}`,
		`{"id":"u-` + "\uFFFD" + `x","type":"t","data":{"n":3}}`,
		`{"id":"u-\ud83d\ude00","type":"t","data":{"n":4}}`,
	} {
		b.Publish(consumer.Message{Value: []byte(v)})
	}
	cfg := fastConfig("envelope-id-text")
	cfg.Envelope = consumer.JSONEnvelope{}
	cfg.Identify.Fingerprint = func(m *consumer.Message) []byte {
		o, err := consumer.JSONEnvelope{}.Open(m.Value)
		if err != nil {
			return nil
		}
		sum := sha256.Sum256(o.Payload)
		return sum[:]
	}
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 6 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, map[string]int{"u-\uFFFD": 1, "u-\uFFFDx": 1, "u-😀": 1}, countEffects(t, pool))
	var kinds []string
	for _, dl := range b.DeadLetters() {
		kinds = append(kinds, dl.Headers[consumer.HeaderErrorKind])
	}
	assert.Equal(t, []string{"decode", "decode", "decode"}, kinds)
	assert.Zero(t, c.Stats().Duplicates, "no event is taken for another")
}

// The same at the envelope: what is text opens, and a number is no string.
func TestJSONEnvelopeOpensOnlyAnIDThatIsText(t *testing.T) {
	for value, id := range map[string]string{
		`{"id":"\\ud83d","data":1}`:      `\ud83d`, // an escaped backslash, then text
		`{"id":"\ud83d\ude00","data":1}`: "😀",
		`{"id":"\u00e9\ufffd","data":1}`: "é\uFFFD",
		`{"id":123,"data":1}`:            "123",
		`{"type":"\ud83d","data":1}`:     "", // a type that is not text is no handler's
	} {
		o, err := consumer.JSONEnvelope{}.Open([]byte(value))
		require.NoError(t, err, value)
		assert.Equal(t, id, o.ID, value)
	}
	for _, value := range []string{`{"id":"\ud83d\u0041","data":1}`, `{"id":"\ud83d\ud83d","data":1}`, `{"id":"\ude00x","data":1}`, "{\"id\":\"\xed\xa0\xbd\",\"data\":1}"} {
		_, err := consumer.JSONEnvelope{}.Open([]byte(value))
		assert.ErrorContains(t, err, "envelope id: not UTF-8 text", value)
	}
}
