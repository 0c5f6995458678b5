package kafkaout

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceco/once/outbox"
)

// Records refused with their batch by a topic whose max.message.bytes is
// below the producer's limit are sent again one at a time, with sarama's
// SendMessage, which takes no context: when the broker stopped answering
// during those sends, Publish waited sarama's request timeouts and
// retries (half a minute a try by default) whatever its context, as it
// did before TestPublishReturnsWhenItsContextEnds' fix. The relay then
// gave the call up past PublishTimeout and its leadership with it. The
// sends one at a time end with the context too, as a passing failure.
func TestResendOneAtATimeReturnsWhenItsContextEnds(t *testing.T) {
	p, recs, held := resendHeld(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	published := make(chan []error, 1)
	started := time.Now()
	go func() { published <- p.Publish(ctx, recs) }()
	select {
	case errs := <-published:
		require.Len(t, held, 1, "a record was sent again one at a time")
		require.Len(t, errs, len(recs))
		for i, err := range errs {
			assert.False(t, outbox.IsRejected(err), "record %d: not charged: %v", i, err)
		}
		assert.Less(t, time.Since(started), 5*time.Second)
	case <-time.After(10 * time.Second):
		t.Fatalf("Publish has not returned %v after its context (1s) ended: the sends one at a time ignore it", time.Since(started)-time.Second)
	}
}

// Close may be called from any goroutine while Publish runs. Closed while
// records refused with their batch were being sent again one at a time,
// the publisher went on with the next record on the closed sarama
// producer, which panics ("send on closed channel"). Publish returns, its
// records failed as passing failures.
func TestCloseDuringTheResendOneAtATimeDoesNotPanic(t *testing.T) {
	p, recs, held := resendHeld(t)
	published := make(chan any, 1)
	go func() {
		defer func() {
			if p := recover(); p != nil {
				published <- p
			}
		}()
		published <- p.Publish(t.Context(), recs)
	}()
	select {
	case <-held:
	case <-time.After(10 * time.Second):
		t.Fatal("no record was sent again one at a time")
	}
	_ = p.Close() // the record in flight is held: Close gives up waiting after 2 s
	release(t)
	select {
	case out := <-published:
		errs, ok := out.([]error)
		require.True(t, ok, "Publish panicked after Close: %v", out)
		require.Len(t, errs, len(recs))
	case <-time.After(20 * time.Second):
		t.Fatal("Publish has not returned after Close")
	}
}

// resendHeld returns a publisher on a cluster whose topic "small" refuses
// a batch of the records returned (max.message.bytes below their sum) and
// holds every produce request after that refusal (the sends one at a
// time; held is signalled at the first) until release(t) or the test's end.
func resendHeld(t *testing.T) (*Publisher, []outbox.Record, chan struct{}) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1))
	require.NoError(t, err)
	t.Cleanup(kf.Close)
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	admin, err := sarama.NewClusterAdmin(kf.ListenAddrs(), sc)
	require.NoError(t, err)
	limit := "10000"
	require.NoError(t, admin.CreateTopic("small", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"max.message.bytes": &limit}}, false))
	require.NoError(t, admin.Close())
	var refused atomic.Bool
	held, unheld := make(chan struct{}, 1), make(chan struct{})
	kf.ControlKey(kmsg.Produce.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		kf.KeepControl()
		n := 0
		for _, tp := range req.(*kmsg.ProduceRequest).Topics {
			for _, pp := range tp.Partitions {
				n += len(pp.Records)
			}
		}
		if !refused.Load() { // up to the batch the topic refuses
			refused.Store(n > 10000)
			return nil, nil, false
		}
		select {
		case held <- struct{}{}:
		default:
		}
		kf.SleepControl(func() { <-unheld })
		return nil, nil, false
	})
	var once sync.Once
	releases.Store(t, func() { once.Do(func() { close(unheld) }) })
	t.Cleanup(func() { release(t) }) // before kf.Close
	p, err := New(Config{Brokers: kf.ListenAddrs(), Sarama: sc})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	var recs []outbox.Record
	for i := range 30 {
		recs = append(recs, outbox.Record{Seq: int64(i), EventID: fmt.Sprintf("e-%d", i), Topic: "small",
			Key: []byte(fmt.Sprint(i % 3)), Body: make([]byte, 1000)})
	}
	return p, recs, held
}

var releases sync.Map // *testing.T → func()

// release lets the produce requests resendHeld holds through.
func release(t *testing.T) {
	if f, ok := releases.Load(t); ok {
		f.(func())()
	}
}
