package consumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// An envelope that does not open hides the envelope's id and type, but
// not those its message carries outside it, which come first whatever the
// envelope holds (Message.ID and Type, the IDHeaders and TypeHeaders): the
// dead letter names them, as a Decoder's failure does, so that the event
// is found by its id in the dead-letter queue (once dlq -id), in the log
// and in OnOutcome. It named neither on a broker without an id property
// (Kafka). The position is not used: the envelope's id, unknown, would
// come before it.
func TestEnvelopeThatDoesNotOpenIsDeadLetteredUnderTheHeadersID(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1, FallbackID: true})
	b.Publish(consumer.Message{Value: []byte(`{"id":"evt-42","type":"order.paid","data":`),
		Headers: map[string]string{"id": "evt-42", "type": "order.paid"}})
	cfg := fastConfig("envelope-header-id")
	cfg.Envelope = consumer.JSONEnvelope{}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error { return nil }
	o := onlyOutcome(t, pool, b, h, cfg)
	require.Equal(t, consumer.ResultDeadLettered, o.Result)
	assert.Equal(t, consumer.KindDecode, o.DeadLetter.Kind)
	assert.Equal(t, "evt-42", o.EventID)
	assert.Equal(t, "order.paid", o.EventType)
	require.Len(t, b.DeadLetters(), 1)
	dl := b.DeadLetters()[0]
	assert.Equal(t, "evt-42", dl.Headers[consumer.HeaderEventID])
	assert.Equal(t, "order.paid", dl.Headers[consumer.HeaderEventType])
}

// panickingEnvelope is a user's Envelope with a bug.
type panickingEnvelope struct{}

func (panickingEnvelope) Open([]byte) (consumer.Opened, error) { panic("index out of range") }

// A custom Envelope that panics is dead-lettered with kind panic under the
// id and type its message carries outside the envelope, as one that fails
// to open is (above): the dead letter named none.
func TestEnvelopeThatPanicsIsDeadLetteredUnderTheHeadersID(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1, FallbackID: true})
	b.Publish(consumer.Message{Value: []byte(`{}`),
		Headers: map[string]string{"id": "evt-43", "type": "order.paid"}})
	cfg := fastConfig("envelope-panic-header-id")
	cfg.Envelope = panickingEnvelope{}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error { return nil }
	o := onlyOutcome(t, pool, b, h, cfg)
	require.Equal(t, consumer.ResultDeadLettered, o.Result)
	assert.Equal(t, consumer.KindPanic, o.DeadLetter.Kind)
	assert.Equal(t, "evt-43", o.EventID)
	require.Len(t, b.DeadLetters(), 1)
	dl := b.DeadLetters()[0]
	assert.Equal(t, "evt-43", dl.Headers[consumer.HeaderEventID])
	assert.Equal(t, "order.paid", dl.Headers[consumer.HeaderEventType])
}

// An EventID that returns an empty id and no error leaves the message to
// its fallback id, as Config.Identify.EventID says; without one, the
// message is dead-lettered as missing-id.
func TestEventIDEmptyTakesTheFallbackID(t *testing.T) {
	for _, fallback := range []bool{true, false} {
		t.Run(fmt.Sprintf("fallback=%v", fallback), func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			b := memsource.New(memsource.Options{Streams: 1, FallbackID: fallback})
			b.Publish(consumer.Message{Value: []byte(`{"n":1}`)})
			cfg := fastConfig("eventid-empty")
			cfg.Identify.EventID = func(*consumer.Message) (string, error) { return "", nil }
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error { return nil }
			o := onlyOutcome(t, pool, b, h, cfg)
			if fallback {
				assert.Equal(t, consumer.ResultHandled, o.Result)
				assert.NotEmpty(t, o.EventID)
				return
			}
			require.Equal(t, consumer.ResultDeadLettered, o.Result)
			assert.Equal(t, consumer.KindMissingID, o.DeadLetter.Kind)
		})
	}
}

// onlyOutcome runs a consumer of b's one message with handler h and cfg,
// and returns the outcome of that message.
func onlyOutcome(t *testing.T, pool *pgxpool.Pool, b *memsource.Broker, h consumer.Handler[order], cfg consumer.Config) consumer.Outcome {
	t.Helper()
	outcomes := make(chan consumer.Outcome, 1)
	cfg.Hooks.OnOutcome = func(_ context.Context, o consumer.Outcome) { outcomes <- o }
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	select {
	case o := <-outcomes:
		return o
	case <-time.After(10 * time.Second):
		t.Fatal("the message was not settled")
		return consumer.Outcome{}
	}
}
