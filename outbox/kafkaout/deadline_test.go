package kafkaout

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceco/once/outbox"
)

// Publish ended only when sarama's SyncProducer did (its request timeouts
// and retries, half a minute a try by default), whatever its context: a
// broker that holds its produce requests held the relay's call past
// RelayConfig.PublishTimeout, and the relay gave the call up and its
// leadership with it. Publish returns when its context ends, each record
// failed with an error wrapping the context's (a passing failure: the
// relay sends them again, with their ids), and the next call, once the
// broker answers, uses a new producer.
func TestPublishReturnsWhenItsContextEnds(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
	require.NoError(t, err)
	defer kf.Close()
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	p, err := New(Config{Brokers: kf.ListenAddrs(), Sarama: sc})
	require.NoError(t, err)
	defer p.Close()
	require.Nil(t, p.Publish(t.Context(), []outbox.Record{{EventID: "e-0", Topic: "orders", Body: []byte("b")}}))

	held, release := holdRequests(t, kf, kmsg.Produce.Int16())
	publishGivenUp(t, p, held)

	release()
	require.Eventually(t, func() bool {
		return p.Publish(t.Context(), []outbox.Record{{EventID: "e-3", Topic: "orders", Body: []byte("b")}}) == nil
	}, 30*time.Second, 50*time.Millisecond, "a later call publishes once the broker answers")
}

// holdRequests makes kf hold every request of key until the returned
// release is called (also at the test's end), and signals held at the
// first one.
func holdRequests(t *testing.T, kf *kfake.Cluster, key int16) (held <-chan struct{}, release func()) {
	t.Helper()
	ch := make(chan struct{})
	h := make(chan struct{}, 1)
	kf.ControlKey(key, func(kmsg.Request) (kmsg.Response, error, bool) {
		kf.KeepControl()
		select {
		case h <- struct{}{}:
		default:
		}
		kf.SleepControl(func() { <-ch })
		return nil, nil, false
	})
	var once sync.Once
	release = func() { once.Do(func() { close(ch) }) }
	t.Cleanup(release)
	return h, release
}

// Connecting (sarama's NewSyncProducer and its first metadata request)
// was bounded by Config.Sarama's Net and Metadata settings alone: against
// a cluster that held its metadata requests, Publish held the relay's
// call for as long as sarama's timeouts and retries, past
// RelayConfig.PublishTimeout, and the relay gave the call and its
// leadership up. Publish returns when its context ends, each record failed
// with an error wrapping the context's (a passing failure); the connect
// goes on aside, and a later call uses it once the cluster answers.
func TestPublishReturnsWhenItsContextEndsWhileConnecting(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
	require.NoError(t, err)
	defer kf.Close()
	held, release := holdRequests(t, kf, kmsg.Metadata.Int16())
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	p, err := New(Config{Brokers: kf.ListenAddrs(), Sarama: sc})
	require.NoError(t, err)
	defer p.Close()

	publishGivenUp(t, p, held)

	release()
	require.Eventually(t, func() bool {
		return p.Publish(t.Context(), []outbox.Record{{EventID: "e-3", Topic: "orders", Body: []byte("b")}}) == nil
	}, 30*time.Second, 50*time.Millisecond, "a later call publishes once the cluster answers")
}

// Close while a connect is in flight returns at once and the producer the
// connect makes afterwards is closed, not kept: Close waited for the
// connect (the publisher's lock held across it), and Publish after Close
// must fail.
func TestCloseWhileConnecting(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
	require.NoError(t, err)
	defer kf.Close()
	held, release := holdRequests(t, kf, kmsg.Metadata.Int16())
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	p, err := New(Config{Brokers: kf.ListenAddrs(), Sarama: sc})
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	published := make(chan []error, 1)
	go func() {
		published <- p.Publish(ctx, []outbox.Record{{EventID: "e-1", Topic: "orders", Body: []byte("b")}})
	}()
	<-held
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close waited for the connect in flight")
	}
	errs := <-published
	require.Len(t, errs, 1)
	require.Error(t, errs[0])
	release()
	errs = p.Publish(t.Context(), []outbox.Record{{EventID: "e-2", Topic: "orders", Body: []byte("b")}})
	require.Len(t, errs, 1)
	require.ErrorContains(t, errs[0], "closed")
}

// publishGivenUp publishes two records with a context that ends after
// 500 ms, while the cluster holds a request (held is signalled when it
// does), and checks that Publish returned when the context ended, each
// record a passing failure wrapping the context's error.
func publishGivenUp(t *testing.T, p *Publisher, held <-chan struct{}) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	started := time.Now()
	errs := p.Publish(ctx, []outbox.Record{{EventID: "e-1", Topic: "orders", Body: []byte("b")}, {EventID: "e-2", Topic: "orders", Body: []byte("b")}})
	took := time.Since(started)
	<-held
	require.Len(t, errs, 2)
	for _, err := range errs {
		require.ErrorIs(t, err, context.DeadlineExceeded)
		assert.False(t, outbox.IsRejected(err), "a passing failure, never charged")
		assert.False(t, outbox.IsRefused(err), "not a refusal of the settings")
	}
	assert.Less(t, took, 10*time.Second, "Publish returned when its context ended")
}
