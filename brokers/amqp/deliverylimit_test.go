package amqp_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// TestDeliveryLimitBelowOneRefusedBeforeRabbitMQ4: the docs' Pitfalls
// tell RabbitMQ 4 users to declare quorum queues with x-delivery-limit -1
// (unlimited). RabbitMQ 3 takes a limit below 1 for 0: a quorum queue so
// declared drops a message at its first redelivery (the queues the source
// declares have no dead-letter exchange), and every unacked message is
// redelivered after a lost connection, a restart or a shutdown. The test
// node is RabbitMQ 3: Open refuses such arguments, for the queue and for
// the dead-letter queue (each read of the dead letters by once dlq is a
// delivery), naming the field, and declares nothing. Before, Open declared
// the queue and every message put back was lost.
func TestDeliveryLimitBelowOneRefusedBeforeRabbitMQ4(t *testing.T) {
	a := newAdmin(t)
	if v, _ := a.conn.Properties["version"].(string); v == "" || v[0] != '3' {
		t.Skipf("the broker is RabbitMQ %q: the rule is RabbitMQ 3's", v)
	}
	for _, tc := range []struct {
		name  string
		edit  func(c *amqp.Config)
		field string
	}{
		{"queue -1", func(c *amqp.Config) { c.QueueArgs = amqp091.Table{"x-delivery-limit": int64(-1)} }, "Config.QueueArgs"},
		{"queue 0", func(c *amqp.Config) { c.QueueArgs = amqp091.Table{"x-delivery-limit": int32(0)} }, "Config.QueueArgs"},
		{"dead-letter queue -1", func(c *amqp.Config) {
			c.DeadLetter.QueueArgs = amqp091.Table{"x-delivery-limit": -1}
		}, "Config.DeadLetter.QueueArgs"},
		// The broker takes any number: a limit read from JSON or YAML
		// into a map is a float64, and an unsigned 0 is 0 too.
		{"queue -1 decoded from JSON", func(c *amqp.Config) { c.QueueArgs = jsonArgs(t, `{"x-delivery-limit": -1}`) }, "Config.QueueArgs"},
		{"queue unsigned 0", func(c *amqp.Config) { c.QueueArgs = amqp091.Table{"x-delivery-limit": uint16(0)} }, "Config.QueueArgs"},
		{"dead-letter queue 0.5", func(c *amqp.Config) {
			c.DeadLetter.QueueArgs = amqp091.Table{"x-delivery-limit": float32(0.5)}
		}, "Config.DeadLetter.QueueArgs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := queueName(t)
			a.cleanupQueue(q)
			cfg := amqp.Config{URL: brokerURL(t), Queue: q, QueueType: amqp.QueueQuorum, Logger: testLogger(t)}
			tc.edit(&cfg)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			src, err := amqp.Open(ctx, cfg)
			if err == nil {
				_ = src.Close()
			}
			require.Error(t, err)
			assert.NotErrorIs(t, err, context.DeadlineExceeded, "refused at once, not retried")
			assert.Contains(t, err.Error(), tc.field)
			assert.Contains(t, err.Error(), "x-delivery-limit")
			_, err = a.ready(q)
			require.Error(t, err, "the queue was not declared")
		})
	}
	// A limit of 1 or more is the operator's (with a dead-letter exchange
	// of their own); classic queues have none.
	q := queueName(t)
	a.cleanupQueue(q)
	openSource(t, amqp.Config{Queue: q, QueueType: amqp.QueueQuorum, QueueArgs: amqp091.Table{"x-delivery-limit": int64(5)}})
}

// TestDeliveryLimitRuleFollowsTheBrokersVersion: RabbitMQ 4 and later
// take -1 for no limit (and have a limit of 20 without it).
func TestDeliveryLimitRuleFollowsTheBrokersVersion(t *testing.T) {
	args := amqp091.Table{"x-delivery-limit": int64(-1)}
	for v, refused := range map[string]bool{"3.10.8": true, "3.13.7": true, "4.0.5": false, "4.1.0": false, "": false, "garbage": false} {
		err := amqp.CheckDeliveryLimit("Config.QueueArgs", args, v)
		assert.Equal(t, refused, err != nil, "%q: %v", v, err)
	}
	assert.NoError(t, amqp.CheckDeliveryLimit("Config.QueueArgs", amqp091.Table{"x-delivery-limit": int64(1)}, "3.10.8"))
	assert.NoError(t, amqp.CheckDeliveryLimit("Config.QueueArgs", nil, "3.10.8"))
	for _, v := range []any{float64(-1), float64(0.99), float32(0), uint8(0), uint32(0)} {
		assert.Error(t, amqp.CheckDeliveryLimit("Config.QueueArgs", amqp091.Table{"x-delivery-limit": v}, "3.10.8"), "%T %v", v, v)
		assert.NoError(t, amqp.CheckDeliveryLimit("Config.QueueArgs", amqp091.Table{"x-delivery-limit": v}, "4.0.5"), "%T %v", v, v)
	}
	for _, v := range []any{float64(1), float64(1.5), uint8(1), "0", "-1"} {
		// A string is no limit to the broker.
		assert.NoError(t, amqp.CheckDeliveryLimit("Config.QueueArgs", amqp091.Table{"x-delivery-limit": v}, "3.10.8"), "%T %v", v, v)
	}
}

// jsonArgs decodes an argument table as a configuration file's loader
// does: numbers become float64.
func jsonArgs(t *testing.T, s string) amqp091.Table {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal([]byte(s), &m))
	return amqp091.Table(m)
}

// TestDeliveryLimitWithoutDeadLetterExchangeWarnsAtOpen: a quorum queue
// with a positive x-delivery-limit and no x-dead-letter-exchange drops a
// message returned to it more often than the limit, and every unacked
// message is returned at each lost connection, restart or shutdown (each
// read of the dead letters by once dlq too). A policy may give the queue a
// dead-letter exchange, so Open does not refuse it, but it logs a warning
// naming the queue, the field and the limit. With a dead-letter exchange
// in the arguments, or on a classic queue, there is none.
func TestDeliveryLimitWithoutDeadLetterExchangeWarnsAtOpen(t *testing.T) {
	a := newAdmin(t)
	open := func(t *testing.T, cfg amqp.Config) []slog.Record {
		t.Helper()
		q := queueName(t)
		a.cleanupQueue(q)
		cfg.Queue = q
		logs := make(logRecords, 1024)
		cfg.Logger = slog.New(logs)
		openSource(t, cfg)
		var warned []slog.Record
		for len(logs) > 0 {
			if r := <-logs; r.Level >= slog.LevelWarn && strings.Contains(r.Message, "x-delivery-limit") {
				warned = append(warned, r)
			}
		}
		return warned
	}
	attrs := func(r slog.Record) map[string]string {
		m := map[string]string{}
		r.Attrs(func(a slog.Attr) bool {
			m[a.Key] = a.Value.String()
			return true
		})
		return m
	}

	warned := open(t, amqp.Config{QueueType: amqp.QueueQuorum, QueueArgs: amqp091.Table{"x-delivery-limit": int64(5)}})
	require.Len(t, warned, 1)
	got := attrs(warned[0])
	assert.Equal(t, "Config.QueueArgs", got["field"])
	assert.Equal(t, "5", got["x-delivery-limit"])
	assert.Contains(t, got["dropping_queue"], "once-test.")

	warned = open(t, amqp.Config{QueueType: amqp.QueueQuorum, DeadLetter: amqp.DeadLetterConfig{QueueArgs: amqp091.Table{"x-delivery-limit": 3}}})
	require.Len(t, warned, 1)
	got = attrs(warned[0])
	assert.Equal(t, "Config.DeadLetter.QueueArgs", got["field"])
	assert.Equal(t, "3", got["x-delivery-limit"])
	assert.True(t, strings.HasSuffix(got["dropping_queue"], amqp.DeadLetterQueueSuffix), got["dropping_queue"])

	x := queueName(t) + ".dlx"
	t.Cleanup(func() {
		if ch, err := a.channel(); err == nil {
			_ = ch.ExchangeDelete(x, false, false)
		}
	})
	require.NoError(t, func() error {
		ch, err := a.channel()
		if err != nil {
			return err
		}
		return ch.ExchangeDeclare(x, "fanout", true, false, false, false, nil)
	}())
	assert.Empty(t, open(t, amqp.Config{QueueType: amqp.QueueQuorum,
		QueueArgs: amqp091.Table{"x-delivery-limit": int64(5), "x-dead-letter-exchange": x}}))
	assert.Empty(t, open(t, amqp.Config{QueueType: amqp.QueueQuorum}))
}

// TestDeliveryLimitRiskFollowsTheBrokersVersion: RabbitMQ 4 gives a quorum
// queue declared without x-delivery-limit a limit of 20, which drops as a
// limit given does; -1 there is no limit. Before RabbitMQ 4 there is no
// default limit.
func TestDeliveryLimitRiskFollowsTheBrokersVersion(t *testing.T) {
	for _, tc := range []struct {
		args    amqp091.Table
		version string
		limit   int64
	}{
		{nil, "3.10.8", 0},
		{nil, "4.0.5", 20},
		{nil, "", 0},
		{amqp091.Table{"x-delivery-limit": int64(-1)}, "4.1.0", 0},
		{amqp091.Table{"x-delivery-limit": int16(7)}, "3.13.7", 7},
		{amqp091.Table{"x-delivery-limit": 7}, "4.0.5", 7},
		{amqp091.Table{"x-dead-letter-exchange": "dlx"}, "4.0.5", 0},
		{amqp091.Table{"x-dead-letter-exchange": "", "x-delivery-limit": int64(3)}, "4.0.5", 0},
		// Any number the broker takes as a limit: floats rounded down.
		{amqp091.Table{"x-delivery-limit": uint8(2)}, "3.10.8", 2},
		{amqp091.Table{"x-delivery-limit": float64(5)}, "3.10.8", 5},
		{amqp091.Table{"x-delivery-limit": float64(2.5)}, "3.10.8", 2},
		{amqp091.Table{"x-delivery-limit": "5"}, "3.10.8", 0},
	} {
		assert.Equal(t, tc.limit, amqp.DeliveryLimitRisk(tc.args, tc.version), "%v on %q", tc.args, tc.version)
	}
}

// TestDeliveryLimitAtOrBelowMaxCrashesWarnsAtNew: the crash guard
// dead-letters a message that crashes the process every time (kind
// crash-loop, with the consumer's diagnostic headers) at its delivery
// after CrashGuard.MaxCrashes redeliveries, and a quorum queue with an
// x-delivery-limit delivers a message again that many times at most (on
// the test node, a limit of 3 gives 4 deliveries, then dead-letters it to
// the queue's own x-dead-letter-exchange). With a limit at or below
// MaxCrashes, crash loops left for the broker's dead-letter exchange
// without a word of why, and lost connections counted towards the limit
// too. consumer.New now warns, naming the limit and MaxCrashes; not above
// it, nor for a classic queue (RabbitMQ refuses the argument for one).
// Before, nothing was said.
func TestDeliveryLimitAtOrBelowMaxCrashesWarnsAtNew(t *testing.T) {
	a := newAdmin(t)
	pool, _ := pgtest.Schema(t)
	warned := func(t *testing.T, cfg amqp.Config, maxCrashes int) []slog.Record {
		t.Helper()
		q := queueName(t)
		a.cleanupQueue(q)
		cfg.Queue = q
		src := openSource(t, cfg)
		logs := make(logRecords, 1024)
		_, err := consumer.New(pool, src, func(context.Context, pgx.Tx, consumer.Event[json.RawMessage]) error { return nil },
			consumer.Config{Name: "limits", CrashGuard: consumer.CrashGuardConfig{MaxCrashes: maxCrashes},
				Telemetry: consumer.TelemetryConfig{Logger: slog.New(logs)}})
		require.NoError(t, err)
		require.NoError(t, src.Close())
		var out []slog.Record
		for len(logs) > 0 {
			if r := <-logs; r.Level >= slog.LevelWarn && strings.Contains(r.Message, "CrashGuard.MaxCrashes") {
				out = append(out, r)
			}
		}
		return out
	}
	quorum := func(limit any) amqp.Config {
		return amqp.Config{QueueType: amqp.QueueQuorum,
			QueueArgs: amqp091.Table{"x-delivery-limit": limit, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "elsewhere"}}
	}
	got := warned(t, quorum(int64(3)), 0) // MaxCrashes' default, 3
	require.Len(t, got, 1)
	attrs := map[string]string{}
	got[0].Attrs(func(a slog.Attr) bool { attrs[a.Key] = a.Value.String(); return true })
	assert.Equal(t, "3", attrs["delivery_limit"])
	assert.Equal(t, "3", attrs["max_crashes"])
	assert.Equal(t, "limits", attrs["consumer"])
	assert.Len(t, warned(t, quorum(int64(2)), 0), 1)
	assert.Len(t, warned(t, quorum(int32(4)), 5), 1, "MaxCrashes raised above the limit")
	assert.Empty(t, warned(t, quorum(int64(4)), 0), "a limit above MaxCrashes")
	assert.Empty(t, warned(t, amqp.Config{QueueType: amqp.QueueQuorum}, 0), "no limit on RabbitMQ 3")
	assert.Empty(t, warned(t, amqp.Config{}, 0), "a classic queue has no delivery limit")
}

// TestDeadLetterQueueLimitWithItsOwnExchangeWarnsAtOpen: every read of the
// dead letters (once dlq list, show, replay, each console page) takes them
// and puts them back, which a quorum queue counts as a delivery. A
// dead-letter queue with an x-delivery-limit and an x-dead-letter-exchange
// of its own therefore moves every dead letter to that exchange after that
// many reads (shown here: a dead letter read and put back leaves the
// dead-letter queue for the exchange's queue), out of once dlq's sight.
// Open warned of a delivery limit only without a dead-letter exchange,
// where the broker drops the messages; now it warns of this one too.
func TestDeadLetterQueueLimitWithItsOwnExchangeWarnsAtOpen(t *testing.T) {
	a := newAdmin(t)
	q := queueName(t)
	a.cleanupQueue(q)
	moved := q + ".moved"
	a.cleanupQueue(moved)
	ch, err := a.channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(moved, true, false, false, false, nil)
	require.NoError(t, err)
	logs := make(logRecords, 1024)
	openSource(t, amqp.Config{Queue: q, QueueType: amqp.QueueQuorum, Logger: slog.New(logs),
		DeadLetter: amqp.DeadLetterConfig{QueueArgs: amqp091.Table{"x-delivery-limit": int64(2),
			"x-dead-letter-exchange": "", "x-dead-letter-routing-key": moved}}})
	var warned []slog.Record
	for len(logs) > 0 {
		if r := <-logs; r.Level >= slog.LevelWarn && strings.Contains(r.Message, "x-delivery-limit") {
			warned = append(warned, r)
		}
	}
	require.Len(t, warned, 1)
	attrs := map[string]string{}
	warned[0].Attrs(func(a slog.Attr) bool { attrs[a.Key] = a.Value.String(); return true })
	assert.Equal(t, q+amqp.DeadLetterQueueSuffix, attrs["dead_letter_queue"])
	assert.Equal(t, "2", attrs["x-delivery-limit"])

	// What it warns of: reads of the dead letters move them away.
	dlq := q + amqp.DeadLetterQueueSuffix
	require.NoError(t, a.publish("", dlq, jsonMsg("dead-1", `{}`)))
	conn, err := amqp091.Dial(brokerURL(t))
	require.NoError(t, err)
	defer conn.Close()
	require.Eventually(t, func() bool {
		// One read: take the dead letter and put it back.
		rch, err := conn.Channel()
		if err != nil {
			return false
		}
		_, _, _ = rch.Get(dlq, false)
		_ = rch.Close()
		n, err := a.ready(moved)
		return err == nil && n == 1
	}, 20*time.Second, 10*time.Millisecond, "the dead letter never left the dead-letter queue")
	n, err := a.ready(dlq)
	require.NoError(t, err)
	assert.Zero(t, n, "the dead letter left the dead-letter queue")
}
