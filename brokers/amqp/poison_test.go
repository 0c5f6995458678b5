package amqp_test

import (
	"context"
	"net/url"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// TestPoisonMessagesDeadLettered publishes a malformed body, a message the
// handler always fails on and one without an id among good ones: each
// poison message lands in the dead-letter queue with its original bytes
// and diagnostic headers, and the stream goes on.
func TestPoisonMessagesDeadLettered(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	good := eventIDs("good", 20)
	msgs := messagesFor(good)
	malformed := []byte(`{"n": oops`)
	poison := []amqp091.Publishing{
		{MessageId: "bad-json", Body: malformed, Headers: amqp091.Table{"x-origin": "test"}},
		{MessageId: "always-fails", Body: []byte(`{"n":1,"fail":true}`)},
		{Body: []byte(`{"n":2}`), Type: "no.id"},
	}
	// Poison in the middle of the stream.
	all := append(append(append([]amqp091.Publishing{}, msgs[:10]...), poison...), msgs[10:]...)
	require.NoError(t, a.publish("", q, all...))

	pool := effectsDB(t)
	src := openSource(t, amqp.Config{Queue: q})
	r := startConsumer(t, pool, src, consumer.Config{
		Name:  "poison-test",
		Retry: consumer.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond},
	}, recordEffect)
	require.Eventually(t, func() bool {
		st := r.c.Stats()
		return st.Handled == uint64(len(good)) && st.DeadLettered == uint64(len(poison))
	}, 60*time.Second, 10*time.Millisecond)
	require.NoError(t, r.stop())
	requireExactlyOnce(t, pool, good)

	dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, dead, len(poison))
	byKind := map[string]amqp091.Delivery{}
	for _, d := range dead {
		h := amqp.HeaderStrings(d.Headers)
		byKind[h[consumer.HeaderErrorKind]] = d
		assert.Equal(t, q, h[amqp.HeaderOriginalQueue])
		assert.Equal(t, q, h[amqp.HeaderOriginalRoutingKey])
		assert.Equal(t, "", h[amqp.HeaderOriginalExchange])
		assert.Equal(t, "poison-test", h[consumer.HeaderConsumer])
		assert.NotEmpty(t, h[consumer.HeaderErrorMessage])
		assert.NotEmpty(t, h[consumer.HeaderFailedAt])
	}
	require.Contains(t, byKind, string(consumer.KindDecode))
	require.Contains(t, byKind, string(consumer.KindHandler))
	require.Contains(t, byKind, string(consumer.KindMissingID))

	dec := byKind[string(consumer.KindDecode)]
	assert.Equal(t, malformed, dec.Body, "the original bytes")
	assert.Equal(t, "bad-json", dec.MessageId)
	assert.Equal(t, "test", dec.Headers["x-origin"], "original headers are kept")
	assert.Equal(t, "bad-json", amqp.HeaderStrings(dec.Headers)[consumer.HeaderEventID])

	hf := byKind[string(consumer.KindHandler)]
	assert.Equal(t, []byte(`{"n":1,"fail":true}`), hf.Body)
	assert.Equal(t, "2", amqp.HeaderStrings(hf.Headers)[consumer.HeaderAttempts])
	assert.Contains(t, amqp.HeaderStrings(hf.Headers)[consumer.HeaderErrorMessage], "always fails")

	mi := byKind[string(consumer.KindMissingID)]
	assert.Equal(t, []byte(`{"n":2}`), mi.Body)
	assert.Equal(t, "no.id", mi.Type)

	ready, err := a.ready(q)
	require.NoError(t, err)
	assert.Zero(t, ready, "poison messages are acked once their copies are confirmed")
}

// TestForeignPublisher consumes messages published by amqp-publish (Debian's
// amqp-tools, a client that is not ours): ids and types come from headers.
func TestForeignPublisher(t *testing.T) {
	t.Parallel()
	brokerURL(t)
	tool, err := exec.LookPath("amqp-publish")
	if err != nil {
		if os.Getenv("ONCE_REQUIRE_SERVERS") == "1" {
			t.Fatal("amqp-publish is missing (Debian package amqp-tools; scripts/ensure-deps.sh installs it)")
		}
		t.Skip("amqp-publish is missing: apt-get install amqp-tools")
	}
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)

	// librabbitmq reads the vhost from the path: "/" would be the vhost "".
	u, err := url.Parse(brokerURL(t))
	require.NoError(t, err)
	if u.Path == "/" {
		u.Path = ""
	}
	publish := func(args ...string) {
		t.Helper()
		out, err := exec.Command(tool, append([]string{"--url=" + u.String(), "--routing-key=" + q, "--persistent", "--content-type=application/json"}, args...)...).CombinedOutput()
		require.NoError(t, err, "amqp-publish: %s", out)
	}
	ids := []string{"tool-1", "tool-2", "tool-3"}
	for i, id := range ids {
		publish("--header=id: "+id, "--header=type: tool.event", "--header=x-note: from amqp-publish", "--body="+`{"n":`+string(rune('1'+i))+`}`)
	}
	publish("--header=type: tool.event", `--body={"n":9}`) // no id anywhere

	pool := effectsDB(t)
	var mu sync.Mutex
	seen := map[string]consumer.Event[payload]{}
	src := openSource(t, amqp.Config{Queue: q})
	r := startConsumer(t, pool, src, consumer.Config{Name: "foreign-test"}, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[payload]) error {
		mu.Lock()
		seen[ev.ID] = ev
		mu.Unlock()
		return recordEffect(ctx, tx, ev)
	})
	require.Eventually(t, func() bool {
		st := r.c.Stats()
		return st.Handled == uint64(len(ids)) && st.DeadLettered == 1
	}, 60*time.Second, 10*time.Millisecond)
	require.NoError(t, r.stop())
	requireExactlyOnce(t, pool, ids)
	mu.Lock()
	defer mu.Unlock()
	for i, id := range ids {
		ev := seen[id]
		assert.Equal(t, "tool.event", ev.Type)
		assert.Equal(t, i+1, ev.Payload.N)
		assert.Equal(t, "from amqp-publish", ev.Message.Headers["x-note"])
		assert.Empty(t, ev.Message.ID, "amqp-publish sets no message-id: the id came from the header")
	}
	dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, dead, 1)
	assert.Equal(t, string(consumer.KindMissingID), amqp.HeaderStrings(dead[0].Headers)[consumer.HeaderErrorKind])
	assert.Equal(t, []byte(`{"n":9}`), dead[0].Body)
}
