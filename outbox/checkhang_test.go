package outbox_test

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/netcut"
	"github.com/onceco/once/outbox"
)

// checkSignal is a publisher whose Check calls are announced on checking
// before they run.
type checkSignal struct {
	outbox.Publisher
	checking chan outbox.Record
}

func (p *checkSignal) Check(rec outbox.Record) error {
	select {
	case p.checking <- rec:
	default:
	}
	return p.Publisher.(outbox.Checker).Check(rec)
}

// RabbitMQ stops answering (its connection held, not closed) while the
// relay checks a record before sending it (amqpout looks up an exchange a
// publish found missing): the lookup gives up after ConfirmTimeout and a
// stop ends soon after, where the check once held Run until the broker
// dropped the connection for missed heartbeats.
func TestRelayStopsWhileACheckWaitsOnAHungBroker(t *testing.T) {
	stopWhileChecksHang(t, outbox.RelayConfig{PollInterval: 20 * time.Millisecond,
		RetryBackoff: outbox.Backoff{Initial: 300 * time.Millisecond, Max: 300 * time.Millisecond}},
		1, "attempts = 1", 10*time.Second)
}

// The same with several records to the missing exchange in the batch (no
// key, so none holds another back): the first lookup that the broker does
// not answer ends the publisher's connection, and the records after it are
// not looked up on it one ConfirmTimeout after another (was: each waited
// its own ConfirmTimeout, so a stop, and every other key's messages,
// waited for as many of them as the batch held).
func TestRelayStopsWhileChecksOfManyRecordsWaitOnAHungBroker(t *testing.T) {
	// Retried at once and never parked: the rows are due together, in one
	// batch, whenever the broker stops answering. ConfirmTimeout is 2s:
	// six lookups one after another would take 12s.
	stopWhileChecksHang(t, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 1 << 20,
		RetryBackoff: outbox.Backoff{Initial: time.Millisecond, Max: time.Millisecond}},
		6, "attempts > 1", 8*time.Second)
}

// stopWhileChecksHang relays n records to a missing exchange through a
// proxy to RabbitMQ, waits until every row was refused (where refused
// holds), makes the broker stop answering, and stops the relay once it
// checks a row again: the stop must take less than bound.
func stopWhileChecksHang(t *testing.T, cfg outbox.RelayConfig, n int, refused string, bound time.Duration) {
	r := rabbitOrSkip(t)
	u, err := url.Parse(r.url)
	require.NoError(t, err)
	proxy, err := netcut.NewProxy(u.Host)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	u.Host = proxy.Addr()
	pub := &checkSignal{Publisher: r.publisherAt(t, u.String()), checking: make(chan outbox.Record, 100)}
	pool, _ := migrated(t)
	cfg.Logger = testLogger()
	relay, err := outbox.NewRelay(pool, pub, cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()

	exchange := uniq("no-such-exchange")
	var msgs []outbox.Message
	for range n {
		msgs = append(msgs, outbox.Message{Topic: exchange, RoutingKey: "x", Body: []byte("x")})
	}
	addCommitted(t, pool, msgs...)
	waitRows(t, pool, refused, n, 30*time.Second) // refused: their exchange is known missing
	for len(pub.checking) > 0 {
		<-pub.checking
	}
	proxy.Pause()
	paused := true
	defer func() {
		if paused {
			proxy.Resume()
		}
	}()
	select {
	case <-pub.checking: // a retry's check, which asks the broker
	case <-time.After(30 * time.Second):
		t.Fatal("the rows were not checked again")
	}
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(60 * time.Second):
		t.Fatal("the relay did not stop")
	}
	assert.Less(t, time.Since(start), bound, "the stop waited for the hung checks")
	proxy.Resume()
	paused = false
}
