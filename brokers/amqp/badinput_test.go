package amqp_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// bigBody is a valid payload of about n bytes.
func bigBody(n int) []byte {
	return []byte(`{"n":7,"note":"` + strings.Repeat("x", n) + `"}`)
}

// The bad-input catalogue through RabbitMQ (the Kafka one is in
// brokers/kafka/badinput_test.go): each row's message, then a good one;
// each row ends with its outcome, the good message is handled, both are
// acked, Run ends cleanly, and a dead letter holds the original bytes.
func TestBadInputCatalogueRabbitMQ(t *testing.T) {
	brokerURL(t)
	const handled = "handled"
	cases := []struct {
		name     string
		msg      amqp091.Publishing
		strict   bool
		router   bool
		fallback bool   // amqp.Config.FallbackID
		want     string // handled or a dead-letter kind
		wantID   string // the event id of a handled message ("fallback": the hash)
	}{
		{name: "empty body", msg: amqp091.Publishing{MessageId: "bad"}, want: string(consumer.KindDecode)},
		{name: "not JSON", msg: jsonMsg("bad", "order 42, paid"), want: string(consumer.KindDecode)},
		{name: "JSON of the wrong shape, default decoder", msg: jsonMsg("bad", `{"sku":"A-1","qty":3}`), want: handled, wantID: "bad"},
		{name: "JSON of the wrong shape, StrictJSON", msg: jsonMsg("bad", `{"sku":"A-1","qty":3}`), strict: true, want: string(consumer.KindDecode)},
		{name: "unknown type (router)", msg: amqp091.Publishing{MessageId: "bad", Type: "order.refunded", Body: []byte(`{"n":1}`)},
			router: true, want: string(consumer.KindUnknownType)},
		{name: "no message-id: no fallback by default", msg: amqp091.Publishing{Body: []byte(`{"n":1}`)}, want: string(consumer.KindMissingID)},
		{name: "no message-id, FallbackID on", msg: amqp091.Publishing{Body: []byte(`{"n":1}`)}, fallback: true, want: handled, wantID: "fallback"},
		// message-id is an AMQP short string (at most 255 bytes): a longer
		// id can only come in a header.
		{name: "id header of 257 bytes", msg: amqp091.Publishing{Headers: amqp091.Table{"id": strings.Repeat("i", 257)}, Body: []byte(`{"n":1}`)},
			want: string(consumer.KindInvalidID)},
		{name: "message-id with invalid UTF-8", msg: jsonMsg("bad-\xff\xfe", `{"n":1}`), want: string(consumer.KindInvalidID)},
		{name: "header with invalid UTF-8", msg: amqp091.Publishing{MessageId: "bad", Headers: amqp091.Table{"x-note": "\xff\xfe", "x-raw": []byte{0xc3, 0x28}},
			Body: []byte(`{"n":1}`)}, want: handled, wantID: "bad"},
		{name: "garbage traceparent", msg: amqp091.Publishing{MessageId: "bad", Headers: amqp091.Table{"traceparent": "zz-not-a-trace"},
			Body: []byte(`{"n":1}`)}, want: handled, wantID: "bad"},
		{name: "traceparent of the wrong type", msg: amqp091.Publishing{MessageId: "bad", Headers: amqp091.Table{"traceparent": int32(42)},
			Body: []byte(`{"n":1}`)}, want: handled, wantID: "bad"},
		{name: "10 MiB valid body", msg: amqp091.Publishing{MessageId: "bad", Body: bigBody(10 << 20)}, want: handled, wantID: "bad"},
		{name: "10 MiB invalid body", msg: amqp091.Publishing{MessageId: "bad", Body: append(bigBody(10<<20), '}')}, want: string(consumer.KindDecode)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := newAdmin(t)
			q := queueName(t)
			a.declare(q, amqp.QueueClassic)
			good := jsonMsg("good", `{"n":2}`)
			good.Type = "order.created"
			require.NoError(t, a.publish("", q, tc.msg, good), "the broker accepts the message")
			pool := effectsDB(t)
			src := openSource(t, amqp.Config{Queue: q, FallbackID: tc.fallback})
			cfg := consumer.Config{Name: "bad-input", Telemetry: consumer.TelemetryConfig{Logger: testLogger(t)},
				Retry: consumer.RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond}}
			if tc.strict {
				cfg.Decoder = consumer.StrictJSON
			}
			var stats func() consumer.Stats
			var run func(context.Context) error
			if tc.router {
				r := consumer.NewRouter[any](consumer.RouterConfig{UnknownTypes: consumer.DeadLetterUnknownTypes})
				require.NoError(t, consumer.Handle(r, "order.created", recordEffect))
				c, err := consumer.NewRouted(pool, src, r, cfg)
				require.NoError(t, err)
				stats, run = c.Stats, c.Run
			} else {
				c, err := consumer.New(pool, src, recordEffect, cfg)
				require.NoError(t, err)
				stats, run = c.Stats, c.Run
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- run(ctx) }()
			require.Eventually(t, func() bool {
				s := stats()
				return s.Received == 2 && s.Handled+s.DeadLettered == 2
			}, 60*time.Second, 10*time.Millisecond, "both messages settled")
			cancel()
			require.NoError(t, <-done, "Run ends cleanly: no panic, no fatal error")
			ready, err := a.ready(q)
			require.NoError(t, err)
			assert.Zero(t, ready, "both acked")

			effects := map[string]int{}
			rows, err := pool.Query(context.Background(), `SELECT event_id, count(*) FROM effects GROUP BY event_id`)
			require.NoError(t, err)
			var id string
			var n int
			_, err = pgx.ForEachRow(rows, []any{&id, &n}, func() error { effects[id] = n; return nil })
			require.NoError(t, err)
			assert.Equal(t, 1, effects["good"], "the good message after the bad one is handled")
			delete(effects, "good")
			dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
			require.NoError(t, err)
			if tc.want == handled {
				assert.Empty(t, dead)
				require.Len(t, effects, 1, "the bad message has exactly one effect")
				for got := range effects {
					if tc.wantID == "fallback" {
						assert.True(t, strings.HasPrefix(got, amqp.FallbackIDPrefix), "fallback id %q", got)
					} else {
						assert.Equal(t, tc.wantID, got)
					}
				}
				return
			}
			assert.Empty(t, effects, "a dead-lettered message has no effect")
			require.Len(t, dead, 1)
			h := amqp.HeaderStrings(dead[0].Headers)
			assert.Equal(t, tc.want, h[consumer.HeaderErrorKind])
			assert.True(t, bytes.Equal(tc.msg.Body, dead[0].Body), "the original bytes (%d, got %d)", len(tc.msg.Body), len(dead[0].Body))
		})
	}
}
