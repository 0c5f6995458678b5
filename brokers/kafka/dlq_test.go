package kafka

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// A malformed record and a record whose handler always fails go to
// <topic>.dlq with the original bytes and the diagnostic headers, and the
// partition goes on past them.
func TestPoisonRecordsDeadLetteredAndStreamContinues(t *testing.T) {
	eachBroker(t, testPoisonRecordsDeadLettered)
}

func testPoisonRecordsDeadLettered(t *testing.T, kind brokerKind) {
	c := newClusterOf(t, kind)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 1)
	malformed := []byte("{\"n\": oops\x00\xff")
	const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	msgs := events(topic, "ev", 0, 3)
	msgs = append(msgs,
		&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("bad-key"), Value: sarama.ByteEncoder(malformed),
			Headers: []sarama.RecordHeader{
				{Key: []byte("id"), Value: []byte("malformed-1")},
				{Key: []byte("type"), Value: []byte("order.created")},
				{Key: []byte("x-origin"), Value: []byte("legacy-system")},
			}},
		&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("fail-key"), Value: sarama.StringEncoder(`{"n":-1}`),
			Headers: []sarama.RecordHeader{
				{Key: []byte("id"), Value: []byte("fails-1")},
				{Key: []byte("type"), Value: []byte("order.created")},
				{Key: []byte("traceparent"), Value: []byte(traceparent)},
			}})
	msgs = append(msgs, events(topic, "ev", 3, 3)...)
	c.produceHashed(msgs)
	recs := c.readAll(topic)
	require.Len(t, recs, 8)

	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	cfg := consumerConfig("orders-svc")
	cfg.Telemetry.TracerProvider = tp
	var failing int
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
		if ev.ID == "fails-1" {
			failing++ // one stream, one goroutine
			return errors.New("payment service rejected order " + strconv.Itoa(ev.Payload.N))
		}
		return recordEffect(ctx, tx, ev)
	}
	src, err := Open(t.Context(), c.config(group, topic))
	require.NoError(t, err)
	r := startConsumer(t, db, src, cfg, h)
	waitEffects(t, db, 6, 30*time.Second)
	require.Eventually(t, func() bool { return r.c.Stats().DeadLettered == 2 }, 30*time.Second, 10*time.Millisecond)
	require.NoError(t, r.stop())
	requireExactlyOnce(t, db, "ev", 6)
	assert.Equal(t, 3, failing, "MaxAttempts is 3")
	assert.Equal(t, map[int32]int64{0: 8}, c.committed(group, topic, 1), "the partition went on past the poison")

	dl := c.readAll(topic + ".dlq")
	require.Len(t, dl, 2)
	for i, want := range []*sarama.ConsumerMessage{recs[3], recs[4]} {
		got := dl[i]
		assert.Equal(t, want.Value, got.Value, "value byte-identical")
		assert.Equal(t, want.Key, got.Key, "key byte-identical")
		h := map[string]string{}
		for _, rh := range got.Headers {
			h[string(rh.Key)] = string(rh.Value)
		}
		assert.Equal(t, topic, h[consumer.HeaderOriginalTopic])
		assert.Equal(t, "0", h[consumer.HeaderOriginalPartition])
		assert.Equal(t, strconv.FormatInt(want.Offset, 10), h[consumer.HeaderOriginalOffset])
		assert.Equal(t, want.Timestamp.UTC().Format(time.RFC3339Nano), h[consumer.HeaderOriginalTimestamp])
		assert.Equal(t, "orders-svc", h[consumer.HeaderConsumer])
		assert.Equal(t, "order.created", h[consumer.HeaderEventType])
		assert.NotEmpty(t, h[consumer.HeaderErrorMessage])
		failedAt, err := time.Parse(time.RFC3339Nano, h[consumer.HeaderFailedAt])
		require.NoError(t, err)
		assert.WithinDuration(t, time.Now(), failedAt, time.Minute)
		assert.Regexp(t, `^00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]$`, h[consumer.HeaderTraceParent])
		switch i {
		case 0:
			assert.Equal(t, "malformed-1", h[consumer.HeaderEventID])
			assert.Equal(t, string(consumer.KindDecode), h[consumer.HeaderErrorKind])
			assert.Equal(t, "0", h[consumer.HeaderAttempts])
			assert.Equal(t, "legacy-system", h["x-origin"], "original headers kept")
			assert.Equal(t, "malformed-1", h["id"])
		case 1:
			assert.Equal(t, "fails-1", h[consumer.HeaderEventID])
			assert.Equal(t, string(consumer.KindHandler), h[consumer.HeaderErrorKind])
			assert.Equal(t, "3", h[consumer.HeaderAttempts])
			assert.Contains(t, h[consumer.HeaderErrorMessage], "payment service rejected order -1")
			assert.Contains(t, h[consumer.HeaderTraceParent], "4bf92f3577b34da6a3ce929d0e0e4736",
				"the dead-lettering span continues the producer's trace")
		}
	}
}

// A dead-letter topic deleted after start: a poison record is not acked,
// the partition waits at it (its offset is never committed past it) until
// the topic exists again. The records that shared its batch may commit
// meanwhile (the poison does not split a batch), but none is acked: after
// a crash they would be redelivered and skipped as duplicates.
func TestDeletedDeadLetterTopicHoldsThePartition(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		c := newClusterOf(t, kind)
		topic, group := uniq("orders"), uniq("g")
		c.createTopic(topic, 1)
		c.createTopic(topic+".dlq", 1)
		db, _ := pgtest.Schema(t)
		_, err := db.Exec(context.Background(), effectsTable)
		require.NoError(t, err)
		var warns atomicCounter
		cfg := consumerConfig("orders-svc")
		cfg.Telemetry.Logger = warns.logger()
		src, err := Open(t.Context(), c.config(group, topic))
		require.NoError(t, err)
		c.deleteTopic(topic + ".dlq")

		msgs := events(topic, "ev", 0, 2)
		msgs = append(msgs, &sarama.ProducerMessage{Topic: topic, Value: sarama.StringEncoder("not json"),
			Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte("poison-1")}}})
		msgs = append(msgs, events(topic, "ev", 2, 2)...)
		c.produceHashed(msgs)
		r := startConsumer(t, db, src, cfg, recordEffect)

		waitEffects(t, db, 2, 30*time.Second)
		require.Eventually(t, func() bool { return warns.n.Load() >= 3 }, 30*time.Second, 10*time.Millisecond,
			"the core retries the dead-letter write")
		assert.Zero(t, r.c.Stats().DeadLettered)
		assert.Equal(t, uint64(2), r.c.Stats().Handled, "the records after the poison are not settled")
		require.Eventually(t, func() bool { return c.committed(group, topic, 1)[0] == 2 }, 10*time.Second, 10*time.Millisecond,
			"the offset stops at the poison record")

		c.createTopic(topic+".dlq", 1)
		waitEffects(t, db, 4, 60*time.Second)
		require.Eventually(t, func() bool { st := r.c.Stats(); return st.DeadLettered == 1 && st.Handled == 4 },
			60*time.Second, 10*time.Millisecond, "the poison is dead-lettered, then the records after it are acked")
		require.NoError(t, r.stop())
		requireExactlyOnce(t, db, "ev", 4)
		assert.Equal(t, uint64(1), r.c.Stats().DeadLettered)
		dl := c.readAll(topic + ".dlq")
		require.Len(t, dl, 1)
		assert.Equal(t, []byte("not json"), dl[0].Value)
		assert.Equal(t, map[int32]int64{0: 5}, c.committed(group, topic, 1))
	})
}

// A base configuration made for a transactional producer (Transaction.ID
// set) still dead-letters: the dead-letter producer is idempotent, not
// transactional, and a transactional one refuses every send made outside a
// transaction, which the core would retry without end, the partition held
// at its first poison record.
func TestDeadLetterWithATransactionalBaseConfig(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 1)
	c.produce(msg(topic, 0, "poison"))
	cfg := c.config(uniq("g"), topic)
	base := saramaConfig()
	base.Producer.Idempotent = true
	base.Producer.RequiredAcks = sarama.WaitForAll
	base.Net.MaxOpenRequests = 1
	base.Producer.Transaction.ID = "billing-tx"
	cfg.Sarama = base
	s := c.open(cfg)
	d := receive(t, s)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	require.NoError(t, d.DeadLetter(ctx, &consumer.DeadLetter{Kind: consumer.KindDecode, FailedAt: time.Now()}))
	recs := c.readAll(topic + ".dlq")
	require.Len(t, recs, 1)
	assert.Equal(t, "poison", string(recs[0].Value))
	assert.Equal(t, "billing-tx", base.Producer.Transaction.ID, "the caller's configuration is not modified")
}

// A base configuration tuned for a batching producer (Producer.Flush.Messages
// or Bytes, with no Frequency or a long one) still dead-letters at once:
// sarama holds a record until a flush trigger is met, and a dead-letter
// copy, sent alone and waited for, met none; DeadLetter waited until its
// context ended, the core retried it (each retry one more copy in the
// buffer), and the partition was held at its first poison record.
func TestDeadLetterWithABatchingBaseConfig(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flush func(*sarama.Config)
	}{
		{"messages without frequency", func(sc *sarama.Config) { sc.Producer.Flush.Messages = 100 }},
		{"bytes with a long frequency", func(sc *sarama.Config) {
			sc.Producer.Flush.Bytes = 1 << 20
			sc.Producer.Flush.Frequency = time.Hour
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t)
			topic := uniq("orders")
			c.createTopic(topic, 1)
			c.createTopic(topic+".dlq", 1)
			c.produce(msg(topic, 0, "poison"))
			cfg := c.config(uniq("g"), topic)
			base := saramaConfig()
			tc.flush(base)
			cfg.Sarama = base
			s := c.open(cfg)
			d := receive(t, s)
			ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
			defer cancel()
			require.NoError(t, d.DeadLetter(ctx, &consumer.DeadLetter{Kind: consumer.KindDecode, FailedAt: time.Now()}),
				"the copy is sent without waiting for a batch to fill")
			recs := c.readAll(topic + ".dlq")
			require.Len(t, recs, 1)
			assert.Equal(t, "poison", string(recs[0].Value))
			assert.NotZero(t, base.Producer.Flush.Messages+base.Producer.Flush.Bytes, "the caller's configuration is not modified")
		})
	}
}

// The copies of one key land on one dead-letter partition, as the docs
// say, whatever partitioner the base configuration gives its own
// producers: a base with sarama's random (or round-robin) partitioner
// spread them over the dead-letter topic's partitions, and a replay read
// them back out of order.
func TestDeadLetterCopiesOfOneKeyShareAPartitionWithARandomBasePartitioner(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 4)
	const n = 20
	msgs := make([]*sarama.ProducerMessage, 0, n)
	for i := range n {
		m := msg(topic, 0, "poison-"+strconv.Itoa(i))
		m.Key = sarama.StringEncoder("order-7")
		msgs = append(msgs, m)
	}
	c.produce(msgs...)
	cfg := c.config(uniq("g"), topic)
	base := saramaConfig()
	base.Producer.Partitioner = sarama.NewRandomPartitioner
	cfg.Sarama = base
	s := c.open(cfg)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	for _, d := range receiveN(t, s, n) {
		require.NoError(t, d.DeadLetter(ctx, &consumer.DeadLetter{Kind: consumer.KindDecode, FailedAt: time.Now()}))
	}
	recs := c.readAll(topic + ".dlq")
	require.Len(t, recs, n)
	partitions := map[int32]int{}
	for _, r := range recs {
		partitions[r.Partition]++
	}
	assert.Len(t, partitions, 1, "the copies of key order-7 are on partitions %v", partitions)
	assert.False(t, base.Producer.Partitioner("").RequiresConsistency(), "the caller's configuration is not modified")
}
