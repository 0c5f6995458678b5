package amqp_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// TestTopologyRefusedOnReconnect: an exchange of Config.Exchanges made
// internal, or the queue declared again with other arguments, while the
// source runs: the declaration of each reconnect is refused
// (PRECONDITION_FAILED, inequivalent arguments). The source keeps retrying,
// as it does for credentials refused on a reconnect, and logs each refusal
// at level Error naming what the broker holds against the declaration and
// what to do; the delivery of the lost connection cannot be acked, and
// once the topology is restored on the broker the source resumes and the
// message comes again.
func TestTopologyRefusedOnReconnect(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(t *testing.T, ch *amqp091.Channel, q, x string) // the change on the broker
		undo   func(t *testing.T, ch *amqp091.Channel, q, x string)
		want   string // in the error
		advice string // in the log's message
		// passive: Config.Passive, the topology declared by the test.
		passive bool
	}{
		{
			name: "exchange made internal",
			change: func(t *testing.T, ch *amqp091.Channel, q, x string) {
				require.NoError(t, ch.ExchangeDelete(x, false, false))
				require.NoError(t, ch.ExchangeDeclare(x, "direct", true, false, true, false, nil))
			},
			undo: func(t *testing.T, ch *amqp091.Channel, q, x string) {
				require.NoError(t, ch.ExchangeDelete(x, false, false))
			},
			want:   "internal",
			advice: "exists there with other properties",
		},
		{
			name: "queue declared with other arguments",
			change: func(t *testing.T, ch *amqp091.Channel, q, x string) {
				_, err := ch.QueueDelete(q, false, false, false)
				require.NoError(t, err)
				_, err = ch.QueueDeclare(q, true, false, false, false, amqp091.Table{"x-max-length": int64(10)})
				require.NoError(t, err)
			},
			undo: func(t *testing.T, ch *amqp091.Channel, q, x string) {
				_, err := ch.QueueDelete(q, false, false, false)
				require.NoError(t, err)
			},
			want:   "x-max-length",
			advice: "exists there with other properties",
		},
		{
			name: "queue deleted under Passive",
			change: func(t *testing.T, ch *amqp091.Channel, q, x string) {
				_, err := ch.QueueDelete(q, false, false, false)
				require.NoError(t, err)
			},
			undo: func(t *testing.T, ch *amqp091.Channel, q, x string) {
				_, err := ch.QueueDeclare(q, true, false, false, false, nil)
				require.NoError(t, err)
				require.NoError(t, ch.QueueBind(q, "k", x, false, nil))
			},
			want:    "NOT_FOUND",
			advice:  "is missing there",
			passive: true,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			a := newAdmin(t)
			q := queueName(t)
			a.cleanupQueue(q)
			x := q + ".x"
			t.Cleanup(func() {
				if ch, err := a.channel(); err == nil {
					_ = ch.ExchangeDelete(x, false, false)
				}
			})
			cfg := amqp.Config{Queue: q, Exchanges: []amqp.Exchange{{Name: x}}, Bindings: []amqp.Binding{{Exchange: x, RoutingKey: "k"}}}
			if tc.passive {
				ch, err := a.channel()
				require.NoError(t, err)
				require.NoError(t, ch.ExchangeDeclare(x, amqp.DefaultExchangeKind, true, false, false, false, nil))
				tc.undo(t, ch, q, x)
				_, err = ch.QueueDeclare(q+amqp.DeadLetterQueueSuffix, true, false, false, false, nil)
				require.NoError(t, err)
				cfg.Passive = true
			}
			p, through := startProxy(t, brokerURL(t))
			logs := make(logRecords, 4096)
			cfg.URL, cfg.Logger = through, slog.New(logs)
			src := openSource(t, cfg)
			require.NoError(t, a.publish(x, "k", jsonMsg("ev-1", `{}`)))
			d := receive(t, src)

			ch, err := a.channel()
			require.NoError(t, err)
			tc.change(t, ch, q, x) // a queue deleted has lost ev-1: it is published again below
			cutTheConnection(t, p)
			select {
			case <-d.Context().Done():
			case <-time.After(20 * time.Second):
				t.Fatal("the delivery's context outlived its connection")
			}
			require.ErrorIs(t, d.Ack(context.Background()), amqp.ErrChannelClosed, "a delivery of the lost connection was acked")

			got := make(chan consumer.Delivery, 1)
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				defer cancel()
				d, err := src.Receive(ctx)
				if err == nil {
					got <- d
				}
				close(got)
			}()
			for range 2 { // each attempt, not only the first
				errText := awaitLog(t, logs, slog.LevelError, tc.advice)
				assert.Contains(t, errText, tc.want)
			}

			ch, err = a.channel()
			require.NoError(t, err)
			tc.undo(t, ch, q, x)
			awaitLog(t, logs, slog.LevelInfo, "reconnected")
			if tc.name != "exchange made internal" {
				require.NoError(t, a.publish(x, "k", jsonMsg("ev-1", `{}`)))
			}
			d, ok := <-got
			require.True(t, ok, "no delivery after the topology was restored")
			assert.Equal(t, "ev-1", d.Message().ID)
			require.NoError(t, d.Ack(context.Background()))
		})
	}
}
