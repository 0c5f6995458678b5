package amqp_test

import (
	"context"
	"log/slog"
	"net/url"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
)

// declareStream declares queue as a RabbitMQ stream queue, removed when
// the test ends.
func (a *admin) declareStream(queue string) {
	a.t.Helper()
	ch, err := a.channel()
	require.NoError(a.t, err)
	_, err = ch.QueueDeclare(queue, true, false, false, false, amqp091.Table{"x-queue-type": "stream"})
	require.NoError(a.t, err)
	a.cleanupQueue(queue)
}

// A stream queue does not deliver again what a consumer left unacked or
// rejected, and a consumer starts at its end: with Passive (nothing
// declared, so the broker never compared the queue's type with the
// Config's) a source opened on one and consumed from the end, skipping
// what was published before and losing what a crash left unacked. Open
// refuses it, as the broker refuses the declaration without Passive.
func TestPassiveSourceRefusesAStreamQueue(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declareStream(q)
	a.declare(q+amqp.DeadLetterQueueSuffix, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := amqp.Open(ctx, amqp.Config{URL: brokerURL(t), Queue: q, Passive: true, Logger: testLogger(t)})
	require.Error(t, err, "a passive source on a stream queue is refused")
	assert.Contains(t, err.Error(), "stream queue")
	assert.Contains(t, err.Error(), q)
	assert.NoError(t, ctx.Err(), "refused at once, not retried")

	_, err = amqp.Open(ctx, amqp.Config{URL: brokerURL(t), Queue: q, Logger: testLogger(t)})
	require.Error(t, err, "without Passive the broker refuses the classic declaration")
	assert.Contains(t, err.Error(), "PRECONDITION_FAILED")
}

// A user that may not configure the queue (Passive deployments often have
// none) cannot be told the queue's type: the source then refuses the first
// delivery that comes from a stream, before the consumer handles it. A
// classic queue under the same user is consumed as before.
func TestPassiveSourceWithoutConfigurePermissionRefusesAStreamAtItsFirstDelivery(t *testing.T) {
	n := privateNode(t)
	n.ctl(t, "add_user", "reader", "pw-reader")
	n.ctl(t, "set_permissions", "-p", "/", "reader", "^$", ".*", ".*")
	u, err := url.Parse(n.url)
	require.NoError(t, err)
	u.User = url.UserPassword("reader", "pw-reader")
	readerURL := u.String()
	a := newAdminAt(t, n.url)

	stream, classic := queueName(t)+"-stream", queueName(t)+"-classic"
	a.declareStream(stream)
	a.declare(classic, amqp.QueueClassic)
	for _, q := range []string{stream, classic} {
		a.declare(q+amqp.DeadLetterQueueSuffix, amqp.QueueClassic)
	}

	src := openSource(t, amqp.Config{URL: readerURL, Queue: classic, Passive: true})
	require.NoError(t, a.publish("", classic, jsonMsg("ev-1", `{}`)))
	d := receive(t, src)
	assert.Equal(t, "ev-1", d.Message().ID, "a classic queue is consumed")
	require.NoError(t, d.Ack(context.Background()))

	src = openSource(t, amqp.Config{URL: readerURL, Queue: stream, Passive: true})
	require.NoError(t, a.publish("", stream, jsonMsg("ev-2", `{}`)))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got, err := src.Receive(ctx)
	require.Error(t, err, "the stream's delivery is refused, not handed out: %v", got)
	assert.Contains(t, err.Error(), "stream queue")
	assert.Contains(t, err.Error(), "x-stream-offset")
	assert.NoError(t, ctx.Err())
}

// With Passive the broker never compares the queue with the Config, so a
// queue declared elsewhere as transient (lost with its messages when the
// broker restarts) or auto-delete (deleted with its messages when its last
// consumer goes, as on the source's reconnect) was consumed without a
// word. The source consumes it and warns at Open; a durable queue gets no
// warning.
func TestPassiveSourceWarnsOfAQueueTheBrokerMayLose(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	warnings := func(t *testing.T, durable, autoDelete bool) []string {
		t.Helper()
		q := queueName(t)
		ch, err := a.channel()
		require.NoError(t, err)
		_, err = ch.QueueDeclare(q, durable, autoDelete, false, false, nil)
		require.NoError(t, err)
		a.cleanupQueue(q)
		a.declare(q+amqp.DeadLetterQueueSuffix, amqp.QueueClassic)
		logs := make(logRecords, 1024)
		src := openSource(t, amqp.Config{Queue: q, Passive: true, Logger: slog.New(logs)})
		require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
		d := receive(t, src)
		require.NoError(t, d.Ack(context.Background()), "the queue is consumed")
		var warned []string
		for len(logs) > 0 {
			if r := <-logs; r.Level >= slog.LevelWarn {
				warned = append(warned, r.Message)
			}
		}
		return warned
	}
	t.Run("transient", func(t *testing.T) {
		warned := warnings(t, false, false)
		require.Len(t, warned, 1)
		assert.Contains(t, warned[0], "not durable")
	})
	t.Run("auto-delete", func(t *testing.T) {
		warned := warnings(t, true, true)
		require.Len(t, warned, 1)
		assert.Contains(t, warned[0], "auto-delete")
	})
	t.Run("durable", func(t *testing.T) {
		assert.Empty(t, warnings(t, true, false))
	})
}

// Queue arguments that have the broker drop messages nobody handled (a
// length limit that drops the oldest, a message TTL, each without a
// dead-letter exchange; a queue TTL) were declared without a word: the
// consumer never saw those messages, and "nothing lost" was the Config's
// doing. Open warns of each, for the queue and for the dead-letter queue;
// the same limits that refuse publishers or move messages to a dead-letter
// exchange are not warned of.
func TestQueueArgumentsThatDropMessagesAreWarnedOf(t *testing.T) {
	t.Parallel()
	warned := func(t *testing.T, cfg amqp.Config) map[string]string {
		t.Helper()
		q := queueName(t)
		newAdmin(t).cleanupQueue(q)
		cfg.Queue = q
		logs := make(logRecords, 1024)
		cfg.Logger = slog.New(logs)
		openSource(t, cfg)
		got := map[string]string{}
		for len(logs) > 0 {
			r := <-logs
			if r.Level < slog.LevelWarn || !strings.Contains(r.Message, "drop messages") {
				continue
			}
			r.Attrs(func(a slog.Attr) bool {
				if a.Key == "field" {
					_, why, _ := strings.Cut(r.Message, "no consumer handled: ")
					got[why[:12]] = a.Value.String()
				}
				return true
			})
		}
		return got
	}
	got := warned(t, amqp.Config{QueueArgs: amqp091.Table{"x-max-length": int64(1000), "x-message-ttl": int64(60000)}})
	assert.Equal(t, map[string]string{"a length lim": "Config.QueueArgs", "x-message-tt": "Config.QueueArgs"}, got)

	got = warned(t, amqp.Config{QueueArgs: amqp091.Table{"x-expires": int64(3600000)},
		DeadLetter: amqp.DeadLetterConfig{QueueArgs: amqp091.Table{"x-max-length-bytes": int64(1 << 20)}}})
	assert.Equal(t, map[string]string{"x-expires de": "Config.QueueArgs", "a length lim": "Config.DeadLetter.QueueArgs"}, got)

	got = warned(t, amqp.Config{QueueArgs: amqp091.Table{"x-max-length": int64(1000), "x-overflow": "reject-publish"}})
	assert.Empty(t, got, "publishers refused, nothing dropped")
	got = warned(t, amqp.Config{QueueArgs: amqp091.Table{"x-message-ttl": int64(60000), "x-dead-letter-exchange": "elsewhere"}})
	assert.Empty(t, got, "expired messages moved to the dead-letter exchange")
	got = warned(t, amqp.Config{})
	assert.Empty(t, got)
}
