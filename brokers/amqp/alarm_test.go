package amqp_test

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// queueCounts returns the ready and unacknowledged messages of queue, as
// the node counts them: the broker's own word on which acks arrived.
func (n node) queueCounts(t testing.TB, queue string) (ready, unacked int) {
	t.Helper()
	out := n.ctl(t, "list_queues", "-q", "--no-table-headers", "name", "messages_ready", "messages_unacknowledged")
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[0] == queue {
			ready, err := strconv.Atoi(f[1])
			require.NoError(t, err, line)
			unacked, err := strconv.Atoi(f[2])
			require.NoError(t, err, line)
			return ready, unacked
		}
	}
	t.Fatalf("queue %s not in list_queues: %s", queue, out)
	return 0, 0
}

// raiseMemoryAlarm lowers the node's memory watermark to zero, which
// blocks every publishing connection, and returns once the broker blocks
// one (waitBlocked). The returned function clears the alarm; it runs at
// cleanup too, and a second call does nothing.
func (n node) raiseMemoryAlarm(t testing.TB) (clear func()) {
	t.Helper()
	n.ctl(t, "set_vm_memory_high_watermark", "0")
	var once sync.Once
	clear = func() { once.Do(func() { n.ctl(t, "set_vm_memory_high_watermark", "0.4") }) }
	t.Cleanup(clear)
	waitBlocked(t, n.url)
	return clear
}

// waitBlocked returns once the broker blocks a connection that publishes:
// the memory monitor raises the alarm on its own schedule, after the
// command that lowers the watermark has returned.
func waitBlocked(t testing.TB, url string) {
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

// closeConnection closes, from the broker's side, the client connections
// named name (the connection_name client property), and returns how many
// it closed.
func (n node) closeConnection(t testing.TB, name string) int {
	t.Helper()
	out := n.ctl(t, "list_connections", "-q", "--no-table-headers", "pid", "client_properties")
	closed := 0
	for _, line := range strings.Split(out, "\n") {
		pid, props, ok := strings.Cut(strings.TrimSpace(line), "\t")
		if ok && strings.Contains(props, `"`+name+`"`) {
			n.ctl(t, "close_connection", pid, "closed by the test")
			closed++
		}
	}
	return closed
}

// TestAlarmBlockingDeadLettersDoesNotStallAcks sets off a memory alarm on
// a node of the test's own (which blocks every connection that publishes)
// while poison messages wait to be dead-lettered among good ones: the good
// ones are still handled and their acks reach the broker, because dead
// letters go out on a connection of their own. Once the alarm clears the
// poison is dead-lettered by the same consumer, one copy each (the copy
// caught by the alarm is confirmed, not published again). Then the broker closes the
// dead-letter connection: the next dead letter goes out on a new one, and
// the consuming connection never reconnects.
func TestAlarmBlockingDeadLettersDoesNotStallAcks(t *testing.T) {
	t.Parallel()
	node := privateNode(t)
	a := newAdminAt(t, node.url)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	good := eventIDs("alarm", 200)
	poison := []amqp091.Publishing{
		{MessageId: "bad-1", Body: []byte(`{"n": oops`)},
		{MessageId: "bad-2", Body: []byte(`not json`)},
		{MessageId: "bad-3", Body: []byte(`{"n":`)},
	}
	require.NoError(t, a.publish("", q, append(append([]amqp091.Publishing{}, poison...), messagesFor(good)...)...))
	pool := effectsDB(t)

	clearAlarm := node.raiseMemoryAlarm(t) // every publishing connection is blocked from now on

	rd := sdkmetric.NewManualReader()
	src := openSource(t, amqp.Config{URL: node.url, Queue: q, Prefetch: 500, ConfirmTimeout: 2 * time.Second,
		ConnectionName: "alarm-test " + q, MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd))})
	r := startConsumer(t, pool, src, consumer.Config{Name: "alarm-test", Concurrency: 8,
		InfraBackoff: consumer.Backoff{Initial: 50 * time.Millisecond, Max: 200 * time.Millisecond}}, recordEffect)

	// Every good message is acked, as the broker counts it, while the
	// poison waits unacked behind its blocked dead-letter publish.
	// The counts for the message are read afresh: a condition still
	// running in its goroutine when Eventually gives up writes what the
	// test would read.
	if !assert.Eventually(t, func() bool {
		ready, unacked := node.queueCounts(t, q)
		return ready == 0 && unacked == len(poison)
	}, 60*time.Second, 50*time.Millisecond) {
		ready, unacked := node.queueCounts(t, q)
		t.Fatalf("acks must reach the broker during the alarm: %d ready, %d unacked; %+v", ready, unacked, r.c.Stats())
	}
	requireExactlyOnce(t, pool, good)
	assert.Zero(t, r.c.Stats().DeadLettered, "nothing is published during the alarm")

	clearAlarm()
	require.Eventually(t, func() bool { return r.c.Stats().DeadLettered == uint64(len(poison)) },
		60*time.Second, 10*time.Millisecond, "the poison is dead-lettered once the alarm clears")
	require.Eventually(t, func() bool {
		ready, unacked := node.queueCounts(t, q)
		return ready == 0 && unacked == 0
	}, 30*time.Second, 50*time.Millisecond)

	// The broker drops the dead-letter connection; the consuming one stays.
	require.Equal(t, 1, node.closeConnection(t, "alarm-test "+q+" (dead letters)"))
	require.NoError(t, a.publish("", q, amqp091.Publishing{MessageId: "bad-4", Body: []byte(`{`)}))
	require.Eventually(t, func() bool { return r.c.Stats().DeadLettered == uint64(len(poison)+1) },
		60*time.Second, 10*time.Millisecond, "a new dead-letter connection after the old one was closed")
	require.NoError(t, r.stop())
	assert.Zero(t, counterValue(t, rd, amqp.ReconnectsMetric), "the consuming connection never reconnected")

	dead, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	ids := make([]string, 0, len(dead))
	for _, d := range dead {
		ids = append(ids, d.MessageId)
	}
	assert.ElementsMatch(t, []string{"bad-1", "bad-2", "bad-3", "bad-4"}, ids)
}

// TestDeadLetterOfALargeCopyUnderAnAlarmKeepsConfirmTimeout: a broker
// under a memory alarm stops reading a connection once it publishes, so
// the frames of a dead-letter copy larger than the sockets' buffers cannot
// all be written. DeadLetter must still return within
// Config.ConfirmTimeout (the consumer retries it with backoff) instead of
// blocking in the write until the alarm clears, with the publisher's lock
// held: every other dead letter, and the consumer's shutdown, would wait
// that long too.
func TestDeadLetterOfALargeCopyUnderAnAlarmKeepsConfirmTimeout(t *testing.T) {
	t.Parallel()
	node := privateNode(t)
	a := newAdminAt(t, node.url)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, amqp091.Publishing{MessageId: "big-1", Body: make([]byte, 64<<20)}))
	src := openSource(t, amqp.Config{URL: node.url, Queue: q, ConfirmTimeout: time.Second})
	d := receive(t, src)

	clearAlarm := node.raiseMemoryAlarm(t)

	dl := &consumer.DeadLetter{Kind: consumer.KindHandler, EventID: "big-1", FailedAt: time.Now()}
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- d.DeadLetter(context.Background(), dl) }()
	select {
	case err := <-done:
		require.Error(t, err, "nothing is confirmed during the alarm")
		assert.Less(t, time.Since(start), 10*time.Second, "DeadLetter must not block past Config.ConfirmTimeout")
	case <-time.After(30 * time.Second):
		clearAlarm() // lets the write, and the test's cleanup, finish
		t.Fatalf("DeadLetter still blocked %v after it began, with a ConfirmTimeout of 1s", time.Since(start).Round(time.Second))
	}
}

// TestCloseUnderAnAlarmIsPrompt: Close while the broker blocks the
// dead-letter connection (a memory alarm), with a copy unconfirmed on it.
// The blocked connection reads nothing, so its close is never answered;
// Close must not wait for it. The message whose copy is unconfirmed is not
// acked and comes back, and the ack of a message the consumer settled
// before Close still reaches the broker.
func TestCloseUnderAnAlarmIsPrompt(t *testing.T) {
	t.Parallel()
	node := privateNode(t)
	a := newAdminAt(t, node.url)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`), jsonMsg("ev-2", `{}`)))
	src := openSource(t, amqp.Config{URL: node.url, Queue: q, ConfirmTimeout: 2 * time.Second})
	d1, d2 := receive(t, src), receive(t, src)
	require.Equal(t, "ev-1", d1.Message().ID)

	clearAlarm := node.raiseMemoryAlarm(t)

	dl := &consumer.DeadLetter{Kind: consumer.KindHandler, EventID: "ev-1", FailedAt: time.Now()}
	require.ErrorIs(t, d1.DeadLetter(context.Background(), dl), amqp.ErrPublisherBlocked)
	require.NoError(t, d2.Ack(context.Background()))

	start := time.Now()
	require.NoError(t, src.Close())
	took := time.Since(start)
	assert.Less(t, took, time.Second, "Close waited for the blocked dead-letter connection")

	clearAlarm()
	require.Eventually(t, func() bool {
		ready, unacked := node.queueCounts(t, q)
		return ready == 1 && unacked == 0
	}, 30*time.Second, 50*time.Millisecond, "ev-2 acked, ev-1 back in the queue")
	got, err := a.getAll(q)
	require.NoError(t, err)
	require.Len(t, got, 1)
	assert.Equal(t, "ev-1", got[0].MessageId, "the message whose copy was not confirmed comes back")
	assert.True(t, got[0].Redelivered)
}
