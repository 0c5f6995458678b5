package dlq_test

import (
	"context"
	"crypto/tls"
	"strconv"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

func amsg(id string, body []byte) amqp091.Publishing {
	return amqp091.Publishing{MessageId: id, Body: body, ContentType: "application/json",
		Headers: amqp091.Table{"x-origin": "test", "x-n": int32(7)}}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// Browsing a queue takes every message and puts it back where it was: two
// browses and a plain consumer afterwards see the publish order, on a
// classic and on a quorum queue; a replay of every third message removes
// those and leaves the rest in order.
func TestAMQPBrowseKeepsOrder(t *testing.T) {
	url := testenv.AMQPURL(t)
	for _, typ := range []string{"classic", "quorum"} {
		t.Run(typ, func(t *testing.T) {
			ch := testenv.AMQPChannel(t, url)
			queue, target := testenv.Uniq("dlq-order"), testenv.Uniq("target")
			testenv.DeleteQueues(t, url, queue, target)
			_, err := ch.QueueDeclare(queue, true, false, false, false, amqp091.Table{"x-queue-type": typ})
			require.NoError(t, err)
			_, err = ch.QueueDeclare(target, true, false, false, false, nil)
			require.NoError(t, err)
			const n = 30
			for i := range n {
				p := amsg("ev-"+strconv.Itoa(i), []byte(strconv.Itoa(i)))
				p.Headers[consumer.HeaderEventID] = "ev-" + strconv.Itoa(i)
				p.Headers["once-original-exchange"] = ""
				p.Headers["once-original-routing-key"] = target
				testenv.PublishAMQP(t, ch, queue, p)
			}
			q, err := dlq.NewAMQP(dlq.AMQPConfig{URL: url, Queue: queue})
			require.NoError(t, err)
			order := func() []string {
				recs, err := dlq.Collect(ctxT(t), q, dlq.Filter{})
				require.NoError(t, err)
				out := make([]string, len(recs))
				for i, r := range recs {
					out[i] = string(r.Value)
				}
				return out
			}
			want := make([]string, n)
			for i := range want {
				want[i] = strconv.Itoa(i)
			}
			require.Equal(t, want, order())
			require.Equal(t, want, order(), "a second browse sees the same order")

			var every3rd []string
			var rest []string
			recs, err := dlq.Collect(ctxT(t), q, dlq.Filter{})
			require.NoError(t, err)
			for i, r := range recs {
				if i%3 == 0 {
					every3rd = append(every3rd, r.Ref)
				} else {
					rest = append(rest, string(r.Value))
				}
			}
			rep, err := q.Replay(ctxT(t), dlq.Filter{Refs: every3rd}, dlq.ReplayOptions{})
			require.NoError(t, err)
			require.Equal(t, n/3, rep.Replayed)
			require.Equal(t, rest, order(), "the replayed messages left the queue, the rest kept their order")

			// A consumer of the queue gets them in that order too.
			got := consumeAll(t, url, queue, len(rest))
			assert.Equal(t, rest, got)
			redriven := consumeAll(t, url, target, n/3)
			assert.Equal(t, "0", redriven[0])
		})
	}
}

func consumeAll(t *testing.T, url, queue string, n int) []string {
	t.Helper()
	conn, err := amqp091.Dial(url)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	ds, err := ch.Consume(queue, "", false, false, false, false, nil)
	require.NoError(t, err)
	var out []string
	timeout := time.After(20 * time.Second)
	for len(out) < n {
		select {
		case d := <-ds:
			out = append(out, string(d.Body))
			require.NoError(t, d.Ack(false))
		case <-timeout:
			t.Fatalf("got %d of %d messages from %s", len(out), n, queue)
		}
	}
	return out
}

// On RabbitMQ, a real consumer dead-letters messages of kinds handler,
// panic, decode and id-conflict, two without any producer id (their id is
// the source's hash fallback). Replayed twice (the first keeping the dead
// letters, the second moving them), then twice at once, each event has one
// effect, and the message that fails on every redrive is back in the queue
// with its history.
func TestAMQPReplayTwiceAndConcurrentlyHasOneEffectPerEvent(t *testing.T) {
	url := testenv.AMQPURL(t)
	queue := testenv.Uniq("orders")
	testenv.DeleteQueues(t, url, queue, queue+".dlq")
	pool, _ := pgtest.Schema(t)
	svc := testenv.StartService(t, pool, testenv.OpenAMQPSource(t, url, queue), "billing")
	ch := testenv.AMQPChannel(t, url)
	msgs := []amqp091.Publishing{
		amsg("ok-1", testenv.JSON(1, "ok")),
		amsg("fail-1", testenv.JSON(3, "fail")),
		amsg("fail-2", testenv.JSON(4, "fail")),
		amsg("panic-1", testenv.JSON(5, "panic")),
		amsg("legacy-1", append([]byte(testenv.LegacyPrefix), testenv.JSON(6, "ok")...)),
		amsg("", testenv.JSON(7, "fail")),
		amsg("", testenv.JSON(8, "fail")),
		amsg("always-1", testenv.JSON(9, "always")),
		amsg("fail-3", testenv.JSON(10, "fail")),
	}
	for _, m := range msgs {
		testenv.PublishAMQP(t, ch, queue, m)
	}
	sent := uint64(len(msgs))
	svc.WaitSettled(t, sent)
	testenv.PublishAMQP(t, ch, queue, amsg("ok-1", testenv.JSON(99, "ok"))) // id-conflict
	sent++
	svc.WaitSettled(t, sent)
	require.EqualValues(t, 9, svc.C.Stats().DeadLettered)

	q, err := dlq.NewAMQP(dlq.AMQPConfig{URL: url, Queue: queue + ".dlq"})
	require.NoError(t, err)
	recs, err := dlq.Collect(ctxT(t), q, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, recs, 9)
	var idLess []string
	for _, r := range recs {
		assert.Equal(t, "(default)/"+queue, r.Destination())
		if r.Properties.MessageID == "" {
			idLess = append(idLess, r.EventID())
		}
	}
	require.Len(t, idLess, 2)

	svc.Broken.Store(false)
	testenv.PublishAMQP(t, ch, queue, amsg("fail-3", testenv.JSON(10, "fail"))) // sent again, handled
	sent++
	svc.WaitSettled(t, sent)

	replay := func(opts dlq.ReplayOptions) dlq.Report {
		rep, err := q.Replay(ctxT(t), dlq.Filter{Consumer: "billing"}, opts)
		require.NoError(t, err)
		return rep
	}
	first := replay(dlq.ReplayOptions{Keep: true, By: "alice"})
	assert.Equal(t, 8, first.Replayed)
	assert.Equal(t, 1, first.Skipped, "the id-conflict")
	sent += 8
	svc.WaitSettled(t, sent)
	second := replay(dlq.ReplayOptions{By: "alice"})
	assert.GreaterOrEqual(t, second.Replayed, 8, "kept dead letters are replayed again")
	sent += uint64(second.Replayed)

	var wg sync.WaitGroup
	var mu sync.Mutex
	for i := range 2 {
		wg.Go(func() {
			rep, err := q.Replay(ctxT(t), dlq.Filter{Consumer: "billing"}, dlq.ReplayOptions{Keep: true, By: "bob-" + strconv.Itoa(i)})
			assert.NoError(t, err)
			mu.Lock()
			sent += uint64(rep.Replayed)
			mu.Unlock()
		})
	}
	wg.Wait()
	svc.WaitSettled(t, sent)

	effects := svc.Effects(t)
	want := append([]string{"ok-1", "fail-1", "fail-2", "panic-1", "legacy-1", "fail-3"}, idLess...)
	for _, id := range want {
		assert.Equal(t, 1, effects[id], "event %s", id)
	}
	assert.Len(t, effects, len(want), "no other effect: %v", effects)

	left, err := dlq.Collect(ctxT(t), q, dlq.Filter{})
	require.NoError(t, err)
	kinds := map[string]int{}
	for _, r := range left {
		kinds[r.Kind()]++
		if r.EventID() == "always-1" {
			assert.GreaterOrEqual(t, r.RedriveCount(), 1)
			assert.NotEmpty(t, r.Header(consumer.HeaderRedrivenBy))
			assert.Equal(t, "test", r.Header("x-origin"))
			assert.Equal(t, "7", r.Header("x-n"), "typed headers travel")
		}
	}
	assert.Equal(t, 1, kinds["id-conflict"], "what was not replayed stays: %v", kinds)
	assert.GreaterOrEqual(t, kinds["handler"], 1, "always-1 came back: %v", kinds)
}

// An AMQPConfig.TLSConfig with an amqp:// URL is refused, as amqp.Open
// refuses it: amqp091 ignores it there and connects without TLS, sending
// the password in clear text to a user who believes TLS is on.
func TestNewAMQPRefusesTLSConfigWithoutAmqps(t *testing.T) {
	_, err := dlq.NewAMQP(dlq.AMQPConfig{URL: "amqp://guest:s3cret@host/", Queue: "orders.dlq", TLSConfig: &tls.Config{}})
	require.ErrorContains(t, err, "AMQPConfig.TLSConfig")
	assert.NotContains(t, err.Error(), "s3cret")
	_, err = dlq.NewAMQP(dlq.AMQPConfig{URL: "amqps://guest:s3cret@host/", Queue: "orders.dlq", TLSConfig: &tls.Config{}})
	require.NoError(t, err)
}

// A RabbitMQ redrive carries the properties of the message dead-lettered:
// those the dead-letter copy keeps (content type and encoding, priority,
// correlation id, reply-to, message id, timestamp, type, app id) and the
// two it could not, kept aside in headers: the expiration, which a
// publisher gives a message that is worth nothing past it (the copy must
// not expire out of the dead-letter queue, the redrive gets it again), and
// the user-id, which the broker lets only that user publish (the replay
// connects as that user here). Before, the redrive had neither.
func TestAMQPRedriveKeepsTheOriginalsProperties(t *testing.T) {
	url := testenv.AMQPURL(t)
	uri, err := amqp091.ParseURI(url)
	require.NoError(t, err)
	queue := testenv.Uniq("props")
	testenv.DeleteQueues(t, url, queue, queue+".dlq")
	pool, _ := pgtest.Schema(t)
	svc := testenv.StartService(t, pool, testenv.OpenAMQPSource(t, url, queue), "billing")
	orig := amqp091.Publishing{
		MessageId:       "props-1",
		Body:            testenv.JSON(1, "fail"),
		Headers:         amqp091.Table{"x-origin": "test"},
		ContentType:     "application/json",
		ContentEncoding: "identity",
		DeliveryMode:    amqp091.Persistent,
		Priority:        7,
		CorrelationId:   "corr-1",
		ReplyTo:         "replies",
		Expiration:      "3600000", // an hour: the redriven message is read long before
		Timestamp:       time.Date(2026, 11, 30, 1, 2, 3, 0, time.UTC),
		Type:            "order.created",
		UserId:          uri.Username,
		AppId:           "shop",
	}
	testenv.PublishAMQP(t, testenv.AMQPChannel(t, url), queue, orig)
	svc.WaitSettled(t, 1)
	require.EqualValues(t, 1, svc.C.Stats().DeadLettered)
	svc.Stop() // the redrive stays in the queue, to be read here

	q, err := dlq.NewAMQP(dlq.AMQPConfig{URL: url, Queue: queue + ".dlq"})
	require.NoError(t, err)
	rep, err := q.Replay(ctxT(t), dlq.Filter{}, dlq.ReplayOptions{})
	require.NoError(t, err)
	require.Equal(t, 1, rep.Replayed)

	conn, err := amqp091.Dial(url)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	var got amqp091.Delivery
	require.Eventually(t, func() bool {
		d, ok, err := ch.Get(queue, true)
		got = d
		return err == nil && ok
	}, 20*time.Second, 10*time.Millisecond, "the redrive never reached %s", queue)
	assert.Equal(t, orig.MessageId, got.MessageId)
	assert.Equal(t, orig.ContentType, got.ContentType)
	assert.Equal(t, orig.ContentEncoding, got.ContentEncoding)
	assert.Equal(t, orig.DeliveryMode, got.DeliveryMode)
	assert.Equal(t, orig.Priority, got.Priority)
	assert.Equal(t, orig.CorrelationId, got.CorrelationId)
	assert.Equal(t, orig.ReplyTo, got.ReplyTo)
	assert.Equal(t, orig.Timestamp, got.Timestamp.UTC())
	assert.Equal(t, orig.Type, got.Type)
	assert.Equal(t, orig.AppId, got.AppId)
	assert.Equal(t, orig.Expiration, got.Expiration, "the expiration")
	assert.Equal(t, orig.UserId, got.UserId, "the user-id")
	assert.Equal(t, "test", got.Headers["x-origin"])
	assert.NotContains(t, got.Headers, "once-original-expiration")
	assert.NotContains(t, got.Headers, "once-original-user-id")
}
