package kafkaout

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/outbox"
)

// silentBroker listens on a loopback port, accepts connections and never
// answers (a port that is not Kafka's, a hung broker). It returns the
// address and a function that reports whether every connection accepted so
// far has been closed by its client.
func silentBroker(t *testing.T) (addr string, accepted func() int, allClosed func() bool) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var (
		mu     sync.Mutex
		conns  []net.Conn
		closed int
	)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				// Read and drop what the client sends, never answering,
				// until the client closes the connection.
				_, _ = io.Copy(io.Discard, c)
				mu.Lock()
				closed++
				mu.Unlock()
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	accepted = func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(conns)
	}
	allClosed = func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(conns) > 0 && closed == len(conns)
	}
	return ln.Addr().String(), accepted, allClosed
}

// Against a broker that accepts the connection and never answers,
// connecting (sarama's NewSyncProducer and its first metadata request)
// lasts sarama's read timeout times its metadata retries (minutes with
// sarama's defaults). Publish returns when its context ends all the same,
// each record a passing failure wrapping the context's error.
func TestPublishToASilentBrokerReturnsWhenItsContextEnds(t *testing.T) {
	addr, accepted, _ := silentBroker(t)
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	p, err := New(Config{Brokers: []string{addr}, Sarama: sc})
	require.NoError(t, err)
	defer p.Close()

	for i := range 2 {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		started := time.Now()
		errs := p.Publish(ctx, []outbox.Record{{EventID: "e-1", Topic: "orders", Body: []byte("b")}, {EventID: "e-2", Topic: "orders", Body: []byte("b")}})
		took := time.Since(started)
		cancel()
		require.Len(t, errs, 2)
		for _, err := range errs {
			require.ErrorIs(t, err, context.DeadlineExceeded, "call %d", i)
			assert.False(t, outbox.IsRejected(err), "a passing failure, never charged")
			assert.False(t, outbox.IsRefused(err), "not a refusal of the settings")
		}
		assert.Less(t, took, 4*time.Second, "call %d returned when its context ended", i)
	}
	assert.Positive(t, accepted(), "the publisher reached the broker")
}

// A connect given up by Publish went on after Close for as long as
// Config.Sarama's timeouts and retries allowed (a minute and a half with
// sarama's defaults against a broker that never answers), holding its
// connection and goroutine after the publisher was closed. Close returns
// at once and ends the connect in flight: its connections are closed and
// it returns within a few seconds, and a later Publish fails.
func TestCloseWhileConnectingToASilentBroker(t *testing.T) {
	addr, accepted, allClosed := silentBroker(t)
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	p, err := New(Config{Brokers: []string{addr}, Sarama: sc})
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	errs := p.Publish(ctx, []outbox.Record{{EventID: "e-1", Topic: "orders", Body: []byte("b")}})
	require.Len(t, errs, 1)
	require.ErrorIs(t, errs[0], context.DeadlineExceeded)
	p.mu.Lock()
	c := p.connecting
	p.mu.Unlock()
	require.NotNil(t, c, "the connect goes on aside")

	started := time.Now()
	require.NoError(t, p.Close())
	assert.Less(t, time.Since(started), time.Second, "Close does not wait for the connect")

	select {
	case <-c.done:
	case <-time.After(5 * time.Second):
		t.Fatalf("the connect in flight went on %v after Close", time.Since(started))
	}
	require.Error(t, c.err)
	assert.Nil(t, c.producer)
	require.Eventually(t, allClosed, 5*time.Second, 20*time.Millisecond,
		"every connection the connect opened is closed (%d accepted)", accepted())
	p.mu.Lock()
	assert.Nil(t, p.producer)
	assert.Nil(t, p.connecting)
	p.mu.Unlock()
	errs = p.Publish(t.Context(), []outbox.Record{{EventID: "e-2", Topic: "orders", Body: []byte("b")}})
	require.Len(t, errs, 1)
	require.ErrorIs(t, errs[0], errClosed)
}

// countingDialer dials TCP and counts its dials.
type countingDialer struct {
	mu sync.Mutex
	n  int
}

func (d *countingDialer) Dial(network, addr string) (net.Conn, error) {
	d.mu.Lock()
	d.n++
	d.mu.Unlock()
	return net.Dial(network, addr)
}

// The producer dials through the dialer of Config.Sarama.Net.Proxy when
// one is set: Close's hold on the connections of a connect in flight
// wraps that dialer, it does not replace it.
func TestPublishDialsThroughTheConfiguredProxyDialer(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
	require.NoError(t, err)
	defer kf.Close()
	d := &countingDialer{}
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	sc.Net.Proxy.Enable = true
	sc.Net.Proxy.Dialer = d
	p, err := New(Config{Brokers: kf.ListenAddrs(), Sarama: sc})
	require.NoError(t, err)
	defer p.Close()
	require.Nil(t, p.Publish(t.Context(), []outbox.Record{{EventID: "e-1", Topic: "orders", Body: []byte("b")}}))
	d.mu.Lock()
	defer d.mu.Unlock()
	assert.Positive(t, d.n, "the configured dialer dialed the broker")
}
