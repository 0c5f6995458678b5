package amqp_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/consumer"
)

// hungDialTimeout is the DialTimeout of the tests below: long, so that a
// call waiting out a connection attempt is told apart from one that gave
// it up when its context ended.
const hungDialTimeout = 20 * time.Second

// TestReceiveReturnsWhenItsContextEndsDuringAReconnect: the connection is
// lost, and the network then holds what the source sends (the broker never
// sees the handshake of the new connection). Receive, reconnecting, returns
// when its context ends, and Close makes it return ErrSourceClosed, without
// waiting out the connection attempt (DialTimeout, then the heartbeats of a
// connection whose channel or declarations are never answered).
func TestReceiveReturnsWhenItsContextEndsDuringAReconnect(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	p, proxied := startProxy(t, brokerURL(t))
	src := openSource(t, amqp.Config{URL: proxied, Queue: q, DialTimeout: hungDialTimeout})

	p.Pause()
	defer p.Resume()
	cutTheConnection(t, p)

	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := src.Receive(ctx)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Less(t, time.Since(start), 5*time.Second, "Receive waited out the connection attempt past its context")

	got := make(chan error, 1)
	go func() {
		_, err := src.Receive(context.Background())
		got <- err
	}()
	// Not for the outcome (a Close before Receive starts ends it at once
	// too): so that Close lands while Receive waits on the attempt.
	time.Sleep(200 * time.Millisecond)
	start = time.Now()
	require.NoError(t, src.Close())
	select {
	case err := <-got:
		assert.ErrorIs(t, err, consumer.ErrSourceClosed)
		assert.Less(t, time.Since(start), 5*time.Second)
	case <-time.After(hungDialTimeout / 2):
		t.Fatal("Receive did not return after Close while it reconnected")
	}
}

// TestOpenReturnsWhenItsContextEndsDuringAConnectionAttempt: Open gives up
// a connection attempt the network holds when its context ends, instead of
// waiting out DialTimeout.
func TestOpenReturnsWhenItsContextEndsDuringAConnectionAttempt(t *testing.T) {
	t.Parallel()
	q := queueName(t)
	p, proxied := startProxy(t, brokerURL(t))
	p.Pause()
	defer p.Resume()
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	src, err := amqp.Open(ctx, amqp.Config{URL: proxied, Queue: q, DialTimeout: hungDialTimeout, Logger: testLogger(t)})
	if err == nil {
		_ = src.Close()
		t.Fatal("Open succeeded through a paused proxy")
	}
	assert.True(t, errors.Is(err, context.DeadlineExceeded), "got %v", err)
	assert.Less(t, time.Since(start), 5*time.Second, "Open waited out the connection attempt past its context")
}

// TestReceivesGivenUpShareOneConnectionAttempt: Receive called again and
// again with short contexts while the network holds the new connection's
// handshake takes over the attempt the previous call gave up, instead of
// piling up one connection attempt per call, and returns a delivery once
// the network lets it through.
func TestReceivesGivenUpShareOneConnectionAttempt(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	p, proxied := startProxy(t, brokerURL(t))
	src := openSource(t, amqp.Config{URL: proxied, Queue: q, DialTimeout: hungDialTimeout})

	p.Pause()
	paused := true
	defer func() {
		if paused {
			p.Resume()
		}
	}()
	cutTheConnection(t, p)
	for range 5 {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		_, err := src.Receive(ctx)
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded)
	}
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
	p.Resume()
	paused = false
	d := receive(t, src)
	assert.Equal(t, "ev-1", d.Message().ID)
	require.NoError(t, d.Ack(context.Background()))
	assert.Equal(t, 1, p.Cut(), "connections through the proxy: the consuming one only")
}

// TestOpenGivenUpLeavesNoConsumer: an Open whose context ended during a
// connection attempt closes what it started. The network lets the
// attempt through afterwards: it must not subscribe to the queue, where a
// consumer nobody reads would take messages (up to the prefetch) and hold
// them unacked for as long as the process lives.
func TestOpenGivenUpLeavesNoConsumer(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	p, proxied := startProxy(t, brokerURL(t))
	p.Pause()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	src, err := amqp.Open(ctx, amqp.Config{URL: proxied, Queue: q, DialTimeout: hungDialTimeout, Logger: testLogger(t)})
	p.Resume()
	if err == nil {
		_ = src.Close()
		t.Fatal("Open succeeded through a paused proxy")
	}
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
	assert.Never(t, func() bool {
		ch, err := a.channel()
		if err != nil {
			return false
		}
		st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		return err == nil && (st.Consumers > 0 || st.Messages == 0)
	}, 2*time.Second, 20*time.Millisecond, "a consumer of the given-up Open subscribed to the queue")
}

// TestDeadLetterReturnsWhenItsContextEndsWhileDialling: the dead-letter
// connection is dialled on the first dead letter; while the network holds
// its handshake, DeadLetter returns when its context ends (the consumer's
// shutdown deadline) instead of waiting out the dial, with the
// publisher's lock held, which Close takes too.
func TestDeadLetterReturnsWhenItsContextEndsWhileDialling(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	q := queueName(t)
	a.declare(q, amqp.QueueClassic)
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
	p, proxied := startProxy(t, brokerURL(t))
	src := openSource(t, amqp.Config{URL: proxied, Queue: q, DialTimeout: hungDialTimeout})
	d := receive(t, src)

	p.Pause()
	defer p.Resume()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := d.DeadLetter(ctx, &consumer.DeadLetter{Kind: consumer.KindHandler, EventID: "ev-1", FailedAt: time.Now()})
	require.Error(t, err)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Less(t, time.Since(start), 5*time.Second, "DeadLetter waited out the dial past its context")
}
