package kafka

import (
	"bytes"
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceco/once/consumer"
)

// A dead-letter topic whose max.message.bytes is below the dead-letter
// producer's Producer.MaxMessageBytes (1 MB by default) refuses a batch of
// copies that together exceed it, though each copy fits alone. sarama
// batches the copies waiting while a produce is in flight (concurrent dead
// letters: several partitions, or key lanes), and the broker refuses the
// whole batch as MESSAGE_TOO_LARGE: every copy in it was then written
// without its value (once-value-dropped), as if it alone were too large.
// The dead letter loses what a replay needs, and the original goes with
// its topic's retention. A copy that fits alone must keep its value.
func TestDeadLetterCopiesBatchedOverTheTopicLimitKeepTheirValues(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(t, err)
	limit := "300000"
	require.NoError(t, admin.CreateTopic(topic+".dlq", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"max.message.bytes": &limit}}, false))
	_ = admin.Close()
	c.awaitLeaders(topic+".dlq", 1)

	const n = 3
	values := make([][]byte, n)
	var msgs []*sarama.ProducerMessage
	for i := range n {
		values[i] = bytes.Repeat([]byte{'a' + byte(i)}, 150_000) // alone well under 300,000
		msgs = append(msgs, &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("k"), Value: sarama.ByteEncoder(values[i]),
			Headers: []sarama.RecordHeader{hdr("id", "ev-"+strconv.Itoa(i))}})
	}
	c.produce(msgs...)

	src := c.open(c.config(group, topic))
	ds := receiveN(t, src, n)

	// The first copy's produce is held, so that the next two wait in the
	// producer's buffer and go in one request, as concurrent dead letters
	// do under load.
	release := make(chan struct{})
	held := make(chan struct{})
	var first sync.Once
	c.kf.ControlKey(kmsg.Produce.Int16(), func(kmsg.Request) (kmsg.Response, error, bool) {
		hold := false
		first.Do(func() { hold = true; close(held) })
		if hold {
			c.kf.SleepControl(func() { <-release })
		}
		return nil, nil, false
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dl := func(d *delivery) error {
		return d.DeadLetter(ctx, &consumer.DeadLetter{Kind: consumer.KindHandler, Error: "rejected", EventID: d.msg.Headers["id"], FailedAt: time.Now()})
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	wg.Add(1)
	go func() { defer wg.Done(); errs[0] = dl(ds[0]) }()
	<-held
	for i := 1; i < n; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = dl(ds[i]) }()
	}
	// Every copy is in the producer: the two later ones wait behind the
	// held produce, to go in one request.
	require.Eventually(t, func() bool { return src.sending.Load() == n }, 10*time.Second, time.Millisecond)
	close(release)
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "copy %d", i)
	}

	recs := c.readAll(topic + ".dlq")
	require.Len(t, recs, n)
	for _, r := range recs {
		h := map[string]string{}
		for _, rh := range r.Headers {
			h[string(rh.Key)] = string(rh.Value)
		}
		off, _ := strconv.Atoi(h[consumer.HeaderOriginalOffset])
		assert.Empty(t, h[HeaderValueDropped], "copy of offset %d: its value fits the topic alone and must not be dropped", off)
		assert.True(t, bytes.Equal(values[off], r.Value), "copy of offset %d keeps the original value (%d bytes, got %d)", off, len(values[off]), len(r.Value))
	}
}

// docs/kafka.md (Rebalances, step 3): "A DeadLetter whose produce was
// already under way when the bound expired may still write its copy (it
// then returns kafka.ErrRevoked and marks nothing)". It returned nil: the
// core then counted the record dead-lettered here (Stats, the outcome
// hooks, the crash guard's record settled) while the partition's next
// owner, to which the record goes back unmarked, dead-letters it again.
func TestDeadLetterUnderWayWhenRevokedReturnsErrRevoked(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	c.produce(msg(topic, 0, `{"n":1}`, "id", "ev-1"))
	src := c.open(c.config(group, topic))
	d := receive(t, src)

	release := make(chan struct{})
	held := make(chan struct{})
	var first sync.Once
	c.kf.ControlKey(kmsg.Produce.Int16(), func(kmsg.Request) (kmsg.Response, error, bool) {
		hold := false
		first.Do(func() { hold = true; close(held) })
		if hold {
			c.kf.SleepControl(func() { <-release })
		}
		return nil, nil, false
	})
	done := make(chan error, 1)
	go func() {
		done <- d.DeadLetter(context.Background(), &consumer.DeadLetter{Kind: consumer.KindHandler, Error: "rejected", FailedAt: time.Now()})
	}()
	<-held
	go func() { _ = src.Close() }() // revokes the claim at once
	require.Eventually(t, d.claim.isRevoked, 10*time.Second, 10*time.Millisecond)
	close(release)
	select {
	case err := <-done:
		require.ErrorIs(t, err, ErrRevoked, "the copy was written, but the record is not this member's to settle any more")
	case <-time.After(20 * time.Second):
		t.Fatal("DeadLetter did not return")
	}
}
