package outbox_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/amqpout"
)

// Under a memory alarm RabbitMQ stops reading a connection once it
// publishes: no confirm comes, and the write of a message larger than the
// socket buffers does not end until the alarm clears. amqpout gives up
// each batch after ConfirmTimeout (an ordinary error: the relay logs it,
// retries, charges no row), and the publisher's Close after the relay
// stopped does not wait for the alarm either. Once the alarm clears, every
// row is published (was: the first batch's write blocked inside amqp091
// for as long as the alarm lasted, the relay stood still without a word,
// and Close, after Run had returned, hung until the alarm cleared).
func TestRelayUnderARabbitMQAlarmKeepsConfirmTimeout(t *testing.T) {
	r, ctl := privateRabbit(t)
	d := r.destination(t)
	pool, _ := migrated(t)
	pub, err := amqpout.New(amqpout.Config{URL: r.url, ConfirmTimeout: time.Second, DialTimeout: 2 * time.Second})
	require.NoError(t, err)
	closed := make(chan struct{})
	t.Cleanup(func() {
		select {
		case <-closed:
		default:
			_ = pub.Close()
		}
	})
	warns := &atomic.Int64{}
	relay, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 1,
		InfraBackoff: outbox.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond}, Logger: countingLogger(warns)})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	addCommitted(t, pool, d.msg("a", "a/0"))
	waitRows(t, pool, "true", 0, 10*time.Second)

	ctl("set_vm_memory_high_watermark", "0")
	alarmOn := true
	clearAlarm := func() {
		if alarmOn {
			ctl("set_vm_memory_high_watermark", "0.4")
			alarmOn = false
		}
	}
	t.Cleanup(clearAlarm)
	waitPublisherBlocked(t, r.url)
	before := warns.Load()
	addCommitted(t, pool, d.msg("b", "b/0/"+strings.Repeat("x", 8<<20)), d.msg("c", "c/0"))
	require.Eventually(t, func() bool { return warns.Load() >= before+3 }, 20*time.Second, 10*time.Millisecond,
		"the relay gives up each batch after ConfirmTimeout (1s) and says so")
	assert.Equal(t, 0, rows(t, pool, "attempts > 0 OR parked_at IS NOT NULL"), "an alarm is not the rows' fault: none charged (MaxAttempts is 1)")

	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("the relay did not stop within 20s of its context's cancellation")
	}
	go func() {
		_ = pub.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		clearAlarm() // lets Close, and the test's cleanup, finish
		t.Fatal("the publisher's Close still waited 10s after the relay stopped, under the alarm")
	}
	assert.Equal(t, 2, rows(t, pool, "true"), "the rows published under the alarm stay")

	clearAlarm()
	startRelay(t, pool, r.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond})
	waitRows(t, pool, "true", 0, 30*time.Second)
	if rd, ok := d.(*rabbitDest); ok {
		// The alarm may have closed the reading channel: read on a new one.
		conn, err := amqp091.Dial(r.url)
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		rd.ch, err = conn.Channel()
		require.NoError(t, err)
	}
	distinct, _ := ids(d.read(t, 3))
	assert.Len(t, distinct, 3, "every row published")
}

// waitPublisherBlocked waits until the broker blocks connections that
// publish (a resource alarm is on), publishing on a connection of its own.
func waitPublisherBlocked(t testing.TB, url string) {
	t.Helper()
	conn, err := amqp091.Dial(url)
	require.NoError(t, err)
	defer func() { _ = conn.CloseDeadline(time.Now()) }() // blocked: do not wait for the broker
	blocked := conn.NotifyBlocked(make(chan amqp091.Blocking, 1))
	ch, err := conn.Channel()
	require.NoError(t, err)
	deadline := time.After(30 * time.Second)
	for {
		// Unroutable and harmless: the default exchange drops it.
		require.NoError(t, ch.PublishWithContext(context.Background(), "", "no-such-queue", false, false, amqp091.Publishing{}))
		select {
		case b := <-blocked:
			if b.Active {
				return
			}
		case <-deadline:
			t.Fatal("the broker did not block a publishing connection within 30s of the alarm")
		case <-time.After(50 * time.Millisecond):
		}
	}
}
