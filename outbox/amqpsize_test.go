package outbox_test

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/rabbittemp"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/amqpout"
)

// privateRabbit starts a RabbitMQ node for t alone (scripts/rabbitmq.sh),
// so that its settings can change without disturbing other tests, and
// returns it with a function that runs rabbitmqctl against it. It skips
// the test where RabbitMQ is not installed, unless ONCE_REQUIRE_SERVERS=1.
func privateRabbit(t *testing.T) (*rabbit, func(args ...string) string) {
	t.Helper()
	script, err := filepath.Abs(filepath.Join("..", "scripts", "rabbitmq.sh"))
	require.NoError(t, err)
	n := rabbittemp.Start(t, script)
	return &rabbit{url: n.URL}, func(args ...string) string {
		t.Helper()
		return n.Ctl(t, args...)
	}
}

// A message larger than the broker's max_message_size closes the
// publishing channel (406), which fails the whole batch: the row is
// charged and parked as refused (checked before it is sent again, so
// that the channel closes once), and every other row, of its batch and
// after, is published.
func TestMessageOverRabbitMQMaxSizeIsParkedOthersGoOn(t *testing.T) {
	r, ctl := privateRabbit(t)
	ctl("eval", "application:set_env(rabbit, max_message_size, 65536).")
	pool, _ := migrated(t)
	d := r.destination(t)
	startRelay(t, pool, r.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond},
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	big := d.msg("a", "a/2")
	big.Body = make([]byte, 100<<10)
	addCommitted(t, pool, d.msg("a", "a/1"), big, d.msg("b", "b/1"), d.msg("a", "a/3"), d.msg("c", "c/1"))
	// Its second attempt was refused by the check, the channel left open.
	waitRows(t, pool, "parked_at IS NOT NULL AND last_error LIKE '%max size 65536 (max_message_size)%'", 1, 30*time.Second)
	all := d.read(t, 3)
	got := firstCopies(all)
	assert.Equal(t, []string{"a/1"}, bodiesOfKey(got, "a"))
	assert.Equal(t, []string{"b/1"}, bodiesOfKey(got, "b"))
	assert.Equal(t, []string{"c/1"}, bodiesOfKey(got, "c"))
	assert.Equal(t, 1, rows(t, pool, "parked_at IS NULL AND sent_at IS NULL"), "a/3 waits behind the parked a/2")
}

// AMQP carries the exchange, routing key, message id, type and header
// names as short strings of at most 255 bytes. A row with a longer one (an
// id of MaxIDLength bytes, a long routing key) cannot be sent: it is
// refused and parked, and every other row is published, where the relay
// once retried it without end (the client failed the publish, or sent half
// of it and the broker closed the connection) and published nothing else.
func TestAMQPShortStringOverflowIsParkedOthersGoOn(t *testing.T) {
	r := rabbitOrSkip(t)
	pool, _ := migrated(t)
	d := r.destination(t)
	startRelay(t, pool, r.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond},
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	longID := d.msg("a", "a/2")
	longID.ID = strings.Repeat("i", outbox.MaxIDLength)
	longKey := d.msg("b", "b/2")
	longKey.RoutingKey = strings.Repeat("r", 300)
	longHeader := d.msg("c", "c/2")
	longHeader.Headers = map[string]string{strings.Repeat("h", 256): "v"}
	addCommitted(t, pool, d.msg("a", "a/1"), longID, d.msg("b", "b/1"), longKey, d.msg("c", "c/1"), longHeader,
		d.msg("d", "d/1"))
	waitRows(t, pool, "parked_at IS NOT NULL AND last_error LIKE '%255 bytes%'", 3, 30*time.Second)
	got := firstCopies(d.read(t, 4))
	for _, k := range []string{"a", "b", "c", "d"} {
		assert.Equal(t, []string{k + "/1"}, bodiesOfKey(got, k))
	}
}

// A row to an exchange the relay's user may not write to, or to an
// internal exchange, closes the publishing channel (403): it is refused
// and parked, and the rows behind it, in its batch and after, are
// published, where every batch from it on
// once failed and the relay published nothing past it.
func TestExchangeWithoutWritePermissionIsParkedOthersGoOn(t *testing.T) {
	r, ctl := privateRabbit(t)
	ctl("add_user", "limited", "secret")
	ctl("set_permissions", "limited", ".*", `^(amq\.default|allowed.*)$`, ".*")
	limited := &rabbit{url: strings.Replace(r.url, "guest:guest", "limited:secret", 1)}
	require.NotEqual(t, r.url, limited.url)
	pool, _ := migrated(t)
	d := r.destination(t)
	startRelay(t, pool, limited.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond},
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	forbidden := func(body string) outbox.Message {
		return outbox.Message{Topic: "forbidden", RoutingKey: "x", Key: []byte("f"), Body: []byte(body)}
	}
	// An internal exchange refuses every publish, whoever sends it.
	conn, err := amqp091.Dial(r.url)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.ExchangeDeclare("allowed-internal", "direct", true, false, true, false, nil))
	internal := outbox.Message{Topic: "allowed-internal", RoutingKey: "x", Key: []byte("i"), Body: []byte("i/1")}
	addCommitted(t, pool, d.msg("a", "a/1"), forbidden("f/1"), d.msg("b", "b/1"), forbidden("f/2"), internal, d.msg("c", "c/1"))
	waitRows(t, pool, "parked_at IS NOT NULL AND last_error LIKE '%ACCESS_REFUSED%'", 2, 30*time.Second)
	waitRows(t, pool, "parked_at IS NULL", 1, 30*time.Second) // f/2, behind the parked f/1
	assert.Equal(t, 1, rows(t, pool, "parked_at IS NULL AND body = 'f/2'"))
	got := firstCopies(d.read(t, 3))
	assert.ElementsMatch(t, []string{"a/1", "b/1", "c/1"}, bodies(got))
}

// A row whose properties and headers do not fit in one AMQP frame (the
// content header cannot be split; frame_max is 128 KiB by default) cannot
// be sent: it is refused and parked, the rows of its key behind it wait,
// and every other row is published, where the broker closed the
// connection (FRAME_ERROR) at every attempt, failing the whole batch, and
// the relay published nothing at all.
func TestAMQPHeadersOverTheFrameSizeAreParkedOthersGoOn(t *testing.T) {
	r := rabbitOrSkip(t)
	pool, _ := migrated(t)
	d := r.destination(t)
	startRelay(t, pool, r.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond},
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	big := d.msg("a", "a/2")
	big.Headers = map[string]string{"big": strings.Repeat("h", 200<<10)}
	// Just under the default frame: sent.
	fits := d.msg("c", "c/1")
	fits.Headers = map[string]string{"fits": strings.Repeat("h", 120<<10)}
	addCommitted(t, pool, d.msg("a", "a/1"), big, d.msg("b", "b/1"), d.msg("a", "a/3"), fits)
	waitRows(t, pool, "parked_at IS NOT NULL AND last_error LIKE '%frame%'", 1, 30*time.Second)
	got := firstCopies(d.read(t, 3))
	assert.ElementsMatch(t, []string{"a/1", "b/1", "c/1"}, bodies(got))
	assert.Equal(t, 1, rows(t, pool, "parked_at IS NULL AND body = 'a/3'"), "a/3 waits behind the parked a/2")
}

// The frame check is tight: the largest headers it lets through are
// confirmed by the broker, and the broker refuses headers 9 bytes longer
// (the check counts the frame's 8 bytes of type, channel, size and end
// octet against frame_max, as the AMQP specification does; RabbitMQ does
// not).
func TestAMQPFrameCheckIsTight(t *testing.T) {
	r := rabbitOrSkip(t)
	d := r.destination(t).(*rabbitDest)
	pub := r.publisher(t).(*amqpout.Publisher)
	rec := func(n int) outbox.Record {
		return outbox.Record{EventID: uniq("e"), RoutingKey: d.queue, Type: "t", Body: []byte("b"), CreatedAt: time.Now(),
			Headers: map[string]string{"h": strings.Repeat("x", n)}}
	}
	ctx := context.Background()
	require.Nil(t, pub.Publish(ctx, []outbox.Record{rec(1)}), "connected")
	lo, hi := 1, 1<<20 // Check passes lo, refuses hi
	require.Error(t, pub.Check(rec(hi)))
	for hi-lo > 1 {
		if mid := (lo + hi) / 2; pub.Check(rec(mid)) == nil {
			lo = mid
		} else {
			hi = mid
		}
	}
	assert.Nil(t, pub.Publish(ctx, []outbox.Record{rec(lo)}), "the largest headers the check lets through are confirmed")
	errs := pub.Publish(ctx, []outbox.Record{rec(lo + 9)})
	require.Len(t, errs, 1)
	assert.Error(t, errs[0], "9 bytes more do not fit in the frame")
}

// RabbitMQ routes a message also by its "CC" and "BCC" headers
// (sender-selected distribution), which must be arrays of strings; an
// outbox header is a string, and the broker closes the channel (406,
// unacceptable_type_in_header) at every publish of a row with one: it is
// refused and parked, the rows of its key behind it wait, and every other
// row is published, where every batch from that row on once failed, no
// row was charged and the relay published nothing past it.
func TestAMQPRoutingHeadersAreParkedOthersGoOn(t *testing.T) {
	r := rabbitOrSkip(t)
	pool, _ := migrated(t)
	d := r.destination(t)
	startRelay(t, pool, r.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond},
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	cc := d.msg("a", "a/2")
	cc.Headers = map[string]string{"CC": "billing"}
	bcc := d.msg("b", "b/2")
	bcc.Headers = map[string]string{"BCC": "audit"}
	// Header names are case-sensitive: RabbitMQ reads "CC" alone.
	lower := d.msg("c", "c/1")
	lower.Headers = map[string]string{"cc": "billing"}
	addCommitted(t, pool, d.msg("a", "a/1"), cc, d.msg("b", "b/1"), bcc, d.msg("a", "a/3"), lower, d.msg("d", "d/1"))
	waitRows(t, pool, "parked_at IS NOT NULL AND last_error LIKE '%CC%'", 2, 30*time.Second)
	got := firstCopies(d.read(t, 4))
	assert.ElementsMatch(t, []string{"a/1", "b/1", "c/1", "d/1"}, bodies(got))
	assert.Equal(t, 1, rows(t, pool, "parked_at IS NULL AND body = 'a/3'"), "a/3 waits behind the parked a/2")
}

// RabbitMQ's topic permissions refuse a routing key, not an exchange: a
// row to a topic exchange with a routing key the relay's user may not
// write closes the channel (403, "write access to topic ... in exchange
// ..."). That row is refused and parked; the rows to the same exchange
// with routing keys the user may write, which failed only because the
// channel closed under them, are published, where they were once charged
// with the refusal and parked beside it.
func TestForbiddenRoutingKeyIsParkedOthersToItsExchangeGoOn(t *testing.T) {
	r, ctl := privateRabbit(t)
	ctl("add_user", "limited", "secret")
	ctl("set_permissions", "limited", ".*", ".*", ".*")
	ctl("set_topic_permissions", "limited", "amq.topic", `^allowed\..*$`, ".*")
	limited := &rabbit{url: strings.Replace(r.url, "guest:guest", "limited:secret", 1)}
	require.NotEqual(t, r.url, limited.url)
	pool, _ := migrated(t)
	d := r.destination(t).(*rabbitDest)
	require.NoError(t, d.ch.QueueBind(d.queue, "allowed."+d.queue, "amq.topic", false, nil))
	startRelay(t, pool, limited.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond},
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	topic := func(routingKey, key, body string) outbox.Message {
		return outbox.Message{Topic: "amq.topic", RoutingKey: routingKey, Key: []byte(key), Body: []byte(body)}
	}
	allowed := "allowed." + d.queue
	addCommitted(t, pool, topic("secret.x", "f", "f/1"), topic(allowed, "a", "a/1"), topic(allowed, "b", "b/1"),
		topic("secret.x", "f", "f/2"), topic(allowed, "a", "a/2"))
	waitRows(t, pool, "parked_at IS NOT NULL AND last_error LIKE '%ACCESS_REFUSED%'", 1, 30*time.Second)
	waitRows(t, pool, "true", 2, 30*time.Second) // f/1 parked, f/2 waiting behind it
	assert.Equal(t, 1, rows(t, pool, "parked_at IS NOT NULL AND body = 'f/1'"))
	assert.Equal(t, 1, rows(t, pool, "parked_at IS NULL AND body = 'f/2'"))
	got := firstCopies(d.read(t, 3))
	assert.Equal(t, []string{"a/1", "a/2"}, bodiesOfKey(got, "a"))
	assert.Equal(t, []string{"b/1"}, bodiesOfKey(got, "b"))
}
