package amqp_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
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
		{
			// Another client's queue of the same name, declared exclusive
			// on its connection: before, each attempt was logged as a
			// broker that cannot be reached.
			name: "queue exclusive to another connection",
			change: func(t *testing.T, ch *amqp091.Channel, q, x string) {
				_, err := ch.QueueDelete(q, false, false, false)
				require.NoError(t, err)
				declareExclusive(t, q)
			},
			undo: func(t *testing.T, ch *amqp091.Channel, q, x string) {
				closeExclusive(t, q)
			},
			want:   "RESOURCE_LOCKED",
			advice: "exclusive to another connection",
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

// exclusiveOwners holds, by queue, the connection declareExclusive
// declared the queue exclusive on.
var exclusiveOwners sync.Map

// declareExclusive declares queue exclusive on a connection of its own,
// as another client would, until closeExclusive or the test's end.
func declareExclusive(t *testing.T, queue string) {
	t.Helper()
	conn, err := amqp091.Dial(brokerURL(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(queue, false, false, true, false, nil)
	require.NoError(t, err)
	exclusiveOwners.Store(queue, conn)
}

// closeExclusive closes the connection that declared queue exclusive:
// the broker deletes the queue.
func closeExclusive(t *testing.T, queue string) {
	t.Helper()
	conn, ok := exclusiveOwners.LoadAndDelete(queue)
	require.True(t, ok)
	require.NoError(t, conn.(*amqp091.Connection).Close())
}

// TestQueueExclusiveToAnotherConnectionRefusedAtOpen: a queue of the
// source's name that another connection declared exclusive
// (RESOURCE_LOCKED for everyone else, to declare or to check) is the
// broker's verdict on the configuration: Open returns it at once, as it
// does a queue declared with other arguments or consumed exclusively.
// Before, Open took it for a broker that cannot be reached, logged
// "cannot connect to the broker" at every attempt and retried until its
// context ended (for ever under context.Background).
func TestQueueExclusiveToAnotherConnectionRefusedAtOpen(t *testing.T) {
	for _, passive := range []bool{false, true} {
		t.Run(fmt.Sprintf("passive=%v", passive), func(t *testing.T) {
			q := queueName(t)
			declareExclusive(t, q)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			src, err := amqp.Open(ctx, amqp.Config{URL: brokerURL(t), Queue: q, Passive: passive, Logger: testLogger(t)})
			if err == nil {
				_ = src.Close()
			}
			require.Error(t, err)
			assert.NotErrorIs(t, err, context.DeadlineExceeded, "refused at once, not retried as an unreachable broker")
			assert.Contains(t, err.Error(), "RESOURCE_LOCKED")
		})
	}
}
