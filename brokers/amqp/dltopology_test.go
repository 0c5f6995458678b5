package amqp_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// deadLetterWithRetries calls d.DeadLetter as the consumer does, again
// after a failure, at most attempts times, and returns the last error.
func deadLetterWithRetries(d consumer.Delivery, attempts int) (err error) {
	for range attempts {
		dl := &consumer.DeadLetter{Kind: consumer.KindHandler, EventID: d.Message().ID, FailedAt: time.Now()}
		if err = d.DeadLetter(context.Background(), dl); err == nil {
			return nil
		}
	}
	return err
}

// TestDeadLetterDestinationDeletedIsDeclaredAgain: the dead-letter queue,
// or the dead-letter exchange, is deleted while the source runs (an
// operator emptying it). The source declared both at Open; it declares
// them again when a copy finds them missing, so the next attempt lands in
// the queue, as the source's own queue is declared again when it is
// deleted. Before, every copy failed (unroutable, or the channel closed
// on the missing exchange) until the process restarted, and each poison
// message stayed unacked, retried without end.
func TestDeadLetterDestinationDeletedIsDeclaredAgain(t *testing.T) {
	for _, tc := range []struct {
		name     string
		exchange bool // a named dead-letter exchange, deleted; else the queue is
	}{{"queue", false}, {"exchange", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			a := newAdmin(t)
			q := queueName(t)
			a.cleanupQueue(q)
			dlq := q + amqp.DeadLetterQueueSuffix
			cfg := amqp.Config{Queue: q}
			if tc.exchange {
				cfg.DeadLetter = amqp.DeadLetterConfig{Exchange: q + ".dlx", RoutingKey: "poison"}
				t.Cleanup(func() {
					if ch, err := a.channel(); err == nil {
						_ = ch.ExchangeDelete(cfg.DeadLetter.Exchange, false, false)
					}
				})
			}
			src := openSource(t, cfg)
			require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`), jsonMsg("ev-2", `{}`)))
			first := receive(t, src)
			require.NoError(t, deadLetterWithRetries(first, 1), "the dead-letter connection works")
			require.NoError(t, first.Ack(context.Background()))

			ch, err := a.channel()
			require.NoError(t, err)
			if tc.exchange {
				require.NoError(t, ch.ExchangeDelete(cfg.DeadLetter.Exchange, false, false))
			} else {
				_, err = ch.QueueDelete(dlq, false, false, false)
				require.NoError(t, err)
			}

			second := receive(t, src)
			require.NoError(t, deadLetterWithRetries(second, 3), "the dead-letter destination is declared again")
			require.NoError(t, second.Ack(context.Background()))
			got, err := a.getAll(dlq)
			require.NoError(t, err)
			var ids []string
			for _, d := range got {
				ids = append(ids, d.MessageId)
			}
			want := []string{"ev-2"} // the queue was deleted with ev-1's copy
			if tc.exchange {
				want = []string{"ev-1", "ev-2"}
			}
			assert.Equal(t, want, ids, "the copy made after the deletion is in the dead-letter queue, once")
		})
	}
}
