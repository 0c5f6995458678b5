package amqp

import (
	"context"
	"log/slog"
	"net/url"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/netcut"
)

// TestLostConnectionWhileSettlingAPendingCopyDoesNotHang: a delivery's
// dead-letter copy was left unconfirmed by an alarm, the alarm cleared, and
// another delivery's DeadLetter waits for that confirm before publishing
// its own copy. The dead-letter connection dies meanwhile: amqp091 nacks
// the pending copy and closes the channel's return notifications. The
// waiting DeadLetter must fail (to be retried on a new connection), not
// read the closed returns channel forever with the publisher's lock held,
// which would stop every later dead letter and Close.
func TestLostConnectionWhileSettlingAPendingCopyDoesNotHang(t *testing.T) {
	broker := testBrokerURL(t)
	u, err := url.Parse(broker)
	require.NoError(t, err)
	proxy, err := netcut.NewProxy(u.Host)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	u.Host = proxy.Addr()
	cfg, err := Config{URL: u.String(), Queue: "once-test.pending-copy"}.withDefaults()
	require.NoError(t, err)
	p := newPublisher(&cfg, slog.New(slog.DiscardHandler))

	// Delivery "a"'s copy, published and not confirmed: the broker sees
	// nothing of it while the proxy holds the traffic.
	p.mu.Lock()
	require.NoError(t, p.ready(context.Background()))
	proxy.Pause()
	paused := true
	t.Cleanup(func() {
		if paused {
			proxy.Resume()
		}
	})
	dc, err := p.ch.PublishWithDeferredConfirmWithContext(context.Background(), "", "no-such-queue", true, false, amqp091.Publishing{})
	require.NoError(t, err)
	p.pending, p.pendingFor = dc, "a"
	blocked := p.blocked
	blocked.changed <- struct{}{} // the alarm's end, which "b" takes while it waits for "a"'s confirm
	p.mu.Unlock()

	done := make(chan error, 1)
	go func() {
		done <- p.publish(context.Background(), "b", "", "no-such-queue", func(int) amqp091.Publishing { return amqp091.Publishing{} }, 30*time.Second)
	}()
	require.Eventually(t, func() bool { return len(blocked.changed) == 0 }, 10*time.Second, time.Millisecond,
		"b waits for a's confirm")
	require.Equal(t, 1, proxy.Cut())
	proxy.Resume()
	paused = false

	select {
	case err := <-done:
		require.Error(t, err, "b's copy was not published: the connection died")
	case <-time.After(10 * time.Second):
		// p.close would wait for the publisher's lock forever.
		t.Fatal("DeadLetter never returned after the dead-letter connection died")
	}
	p.close()
}
