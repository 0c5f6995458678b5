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
	"github.com/onceco/once/outbox/amqpout"
)

// RabbitMQ stops answering while the publisher connects (the connection
// accepted, the handshake never answered: a node frozen, a network holding
// the traffic), and the service stops: Publish gives up when its context
// ends, and Close, which the service calls after the relay's stop, returns
// within the 2 s it promises. Both waited for the connect, which holds the
// publisher's lock, until DialTimeout or until the broker dropped the
// connection for its own handshake timeout (10 s by default).
func TestStopDuringAConnectToAHungBrokerIsPrompt(t *testing.T) {
	r := rabbitOrSkip(t)
	t.Run("publish's context ends", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		pub, published := publishToAHungBroker(t, ctx, r)
		t.Cleanup(func() { _ = pub.Close() })
		start := time.Now()
		cancel()
		requirePublishFailed(t, published)
		assert.Less(t, time.Since(start), 2*time.Second, "Publish waited for the connect after its context ended")
	})
	t.Run("Close", func(t *testing.T) {
		pub, published := publishToAHungBroker(t, context.Background(), r)
		start := time.Now()
		closed := make(chan error, 1)
		go func() { closed <- pub.Close() }()
		select {
		case err := <-closed:
			assert.NoError(t, err, "a connect given up is no failure of Close")
		case <-time.After(30 * time.Second):
			t.Fatal("Close did not return while the publisher connected to a broker that does not answer")
		}
		assert.Less(t, time.Since(start), 2*time.Second+time.Second/2, "Close waited for the connect (it promises at most 2 s)")
		requirePublishFailed(t, published)
	})
}

// publishToAHungBroker starts a Publish under ctx through a proxy to r
// that holds what the publisher sends, and returns once the publisher is
// connecting; its result comes on published.
func publishToAHungBroker(t *testing.T, ctx context.Context, r *rabbit) (pub *amqpout.Publisher, published <-chan []error) {
	u, err := url.Parse(r.url)
	require.NoError(t, err)
	proxy, err := netcut.NewProxy(u.Host)
	require.NoError(t, err)
	proxy.Pause() // the handshake's first bytes never reach the broker
	t.Cleanup(func() {
		proxy.Resume()
		_ = proxy.Close()
	})
	u.Host = proxy.Addr()
	pub, err = amqpout.New(amqpout.Config{URL: u.String(), DialTimeout: 30 * time.Second})
	require.NoError(t, err)
	out := make(chan []error, 1)
	go func() {
		out <- pub.Publish(ctx, []outbox.Record{{EventID: "e-1", RoutingKey: "nowhere", Body: []byte("x")}})
	}()
	require.Eventually(t, func() bool { return proxy.Conns() == 1 }, 10*time.Second, 5*time.Millisecond,
		"the publisher is connecting")
	return pub, out
}

// requirePublishFailed waits for a Publish of one record given up and
// checks that its record was not confirmed.
func requirePublishFailed(t *testing.T, published <-chan []error) {
	t.Helper()
	select {
	case errs := <-published:
		require.Len(t, errs, 1)
		assert.Error(t, errs[0], "a publish given up is not confirmed")
	case <-time.After(30 * time.Second):
		t.Fatal("Publish did not return")
	}
}
