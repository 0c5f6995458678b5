package kafka

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/onceco/once/consumer"
)

func TestOpenValidatesConfig(t *testing.T) {
	old := sarama.NewConfig()
	old.Version = sarama.V0_10_2_0
	badSarama := sarama.NewConfig()
	badSarama.Consumer.Fetch.Default = 0
	ok := Config{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"}}
	for _, tc := range []struct {
		name  string
		edit  func(*Config)
		field string
	}{
		{"no brokers", func(c *Config) { c.Brokers = nil }, "Config.Brokers"},
		{"empty broker", func(c *Config) { c.Brokers = []string{" "} }, "Config.Brokers[0]"},
		{"no group", func(c *Config) { c.Group = "" }, "Config.Group"},
		{"no topics", func(c *Config) { c.Topics = nil }, "Config.Topics"},
		{"empty topic", func(c *Config) { c.Topics = []string{"a", ""} }, "Config.Topics[1]"},
		{"duplicate topic", func(c *Config) { c.Topics = []string{"a", "a"} }, "Config.Topics"},
		{"dlq is the topic", func(c *Config) { c.DeadLetter.Topic = func(t string) string { return t } }, "Config.DeadLetter.Topic"},
		{"empty dlq", func(c *Config) { c.DeadLetter.Topic = func(string) string { return "" } }, "Config.DeadLetter.Topic"},
		{"dlq consumed", func(c *Config) { c.Topics = []string{"t", "t.dlq"} }, "Config.DeadLetter.Topic(\"t\")"},
		{"initial offset", func(c *Config) { c.InitialOffset = 42 }, "Config.InitialOffset"},
		{"negative session", func(c *Config) { c.SessionTimeout = -time.Second }, "Config.SessionTimeout"},
		{"negative commit", func(c *Config) { c.CommitInterval = -time.Second }, "Config.CommitInterval"},
		{"negative fetch", func(c *Config) { c.FetchMax = -1 }, "Config.FetchMax"},
		{"negative pending bound", func(c *Config) { c.MaxPendingPerPartition = -1 }, "Config.MaxPendingPerPartition"},
		{"negative close timeout", func(c *Config) { c.CloseTimeout = -time.Second }, "Config.CloseTimeout"},
		{"heartbeat above session", func(c *Config) { c.HeartbeatInterval = 20 * time.Second }, "Config.HeartbeatInterval"},
		{"revoke above rebalance", func(c *Config) { c.RevokeTimeout = 2 * time.Minute }, "Config.RevokeTimeout"},
		{"old version", func(c *Config) { c.Sarama = old }, "Config.Sarama.Version"},
		{"invalid sarama", func(c *Config) { c.Sarama = badSarama }, "Config.Sarama"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ok
			tc.edit(&cfg)
			s, err := Open(t.Context(), cfg)
			require.Error(t, err)
			assert.Nil(t, s)
			assert.Contains(t, err.Error(), tc.field)
		})
	}
}

// A duration of Config below sarama's lower bound was refused as an error
// of Config.Sarama ("Config.Sarama (consumer): Consumer.MaxWaitTime must
// be >= 1ms"), a field the caller may not have set at all. The error names
// the field of Config that holds it.
func TestOpenNamesTheFieldOfADurationBelowSaramasBound(t *testing.T) {
	for _, tc := range []struct {
		name  string
		edit  func(*Config)
		field string
	}{
		{"fetch max wait", func(c *Config) { c.FetchMaxWait = 500 * time.Microsecond }, "Config.FetchMaxWait"},
		{"heartbeat", func(c *Config) { c.HeartbeatInterval = 500 * time.Microsecond }, "Config.HeartbeatInterval"},
		{"session", func(c *Config) { c.SessionTimeout, c.HeartbeatInterval = 2*time.Millisecond, time.Millisecond }, "Config.SessionTimeout"},
		{"rebalance", func(c *Config) { c.RebalanceTimeout, c.RevokeTimeout = time.Millisecond, time.Microsecond }, "Config.RebalanceTimeout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"}, Logger: testLogger()}
			tc.edit(&cfg)
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			defer cancel()
			s, err := Open(ctx, cfg)
			require.Error(t, err)
			assert.Nil(t, s)
			assert.NotErrorIs(t, err, context.DeadlineExceeded, "refused at once")
			assert.Contains(t, err.Error(), tc.field)
			assert.NotContains(t, err.Error(), "Config.Sarama")
		})
	}
}

// Key lanes are chosen by a 32-bit hash modulo KeyLanes: a count the hash
// cannot address (2^32 makes the modulus 0, a division by zero in the
// claim's goroutine at the first record) is refused by Open.
func TestOpenRefusesKeyLanesBeyondTheHash(t *testing.T) {
	if strconv.IntSize < 64 {
		t.Skip("an int cannot exceed the lane hash's range")
	}
	most := ^uint32(0)
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	cfg := Config{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"}, KeyLanes: int(most) + 1}
	s, err := Open(ctx, cfg)
	require.Error(t, err)
	assert.Nil(t, s)
	assert.Contains(t, err.Error(), "Config.KeyLanes")
}

func TestConfigDefaultsAndOverrides(t *testing.T) {
	base := sarama.NewConfig()
	base.ClientID = "my-service"
	cfg := Config{Brokers: []string{"b:9092"}, Group: "g", Topics: []string{"t"}, Sarama: base}.withDefaults()
	require.NoError(t, cfg.validate())
	cc, err := cfg.consumerConfig()
	require.NoError(t, err)
	pc, err := cfg.producerConfig()
	require.NoError(t, err)

	assert.False(t, base.Producer.Idempotent, "the caller's sarama.Config must not change")
	assert.Equal(t, sarama.OffsetNewest, base.Consumer.Offsets.Initial, "the caller's sarama.Config must not change")

	assert.Equal(t, "my-service", cc.ClientID)
	assert.Equal(t, sarama.OffsetOldest, cc.Consumer.Offsets.Initial)
	assert.True(t, cc.Consumer.Offsets.AutoCommit.Enable)
	assert.Equal(t, DefaultCommitInterval, cc.Consumer.Offsets.AutoCommit.Interval)
	assert.Equal(t, DefaultFetchMaxWait, cc.Consumer.MaxWaitTime)
	assert.Equal(t, 10*time.Second, cc.Consumer.Group.Session.Timeout, "sarama's default is kept")
	assert.Equal(t, "t.dlq", cfg.DeadLetter.Topic("t"))

	assert.True(t, pc.Producer.Idempotent)
	assert.Equal(t, sarama.WaitForAll, pc.Producer.RequiredAcks)
	assert.Equal(t, 1, pc.Net.MaxOpenRequests)
	assert.False(t, pc.Metadata.AllowAutoTopicCreation)

	cfg = Config{
		Brokers: []string{"b:9092"}, Group: "g", Topics: []string{"t"},
		InitialOffset: StartNewest, SessionTimeout: 7 * time.Second, HeartbeatInterval: time.Second,
		RebalanceTimeout: 30 * time.Second, FetchMin: 10, FetchDefault: 1 << 20, FetchMax: 1 << 22,
	}.withDefaults()
	cc, err = cfg.consumerConfig()
	require.NoError(t, err)
	assert.Equal(t, sarama.OffsetNewest, cc.Consumer.Offsets.Initial)
	assert.Equal(t, 7*time.Second, cc.Consumer.Group.Session.Timeout)
	assert.Equal(t, time.Second, cc.Consumer.Group.Heartbeat.Interval)
	assert.Equal(t, 30*time.Second, cc.Consumer.Group.Rebalance.Timeout)
	assert.Equal(t, int32(10), cc.Consumer.Fetch.Min)
	assert.Equal(t, int32(1<<20), cc.Consumer.Fetch.Default)
	assert.Equal(t, int32(1<<22), cc.Consumer.Fetch.Max)
}

// Open tries unreachable brokers again with backoff until its context
// ends, then returns the last failure with the context's cause.
func TestOpenRetriesUnreachableBrokersUntilContextEnds(t *testing.T) {
	sc := sarama.NewConfig()
	sc.Metadata.Retry.Max = 0
	sc.Net.DialTimeout = time.Second
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	// The third "retrying" warning cancels ctx: Open retried twice.
	warnings := &lineCounter{match: "cannot reach the brokers", at: 3, then: cancel}
	cfg := Config{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"}, Sarama: sc,
		ReconnectMinBackoff: time.Millisecond, ReconnectMaxBackoff: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(warnings, nil))}
	_, err := Open(ctx, cfg)
	require.Error(t, err)
	assert.Equal(t, 3, warnings.count(), "Open stopped at the cancel, not before")
	assert.ErrorIs(t, err, sarama.ErrOutOfBrokers)
	assert.ErrorIs(t, err, context.Canceled)
}

// Open returns a configuration error at once, without retrying.
func TestOpenDoesNotRetryAnInvalidConfig(t *testing.T) {
	_, err := Open(t.Context(), Config{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"},
		ReconnectMinBackoff: time.Second, ReconnectMaxBackoff: time.Millisecond})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "Config.ReconnectMinBackoff")
}

func TestReceiveMapsRecord(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 2)
	ts := time.Date(2026, 11, 1, 12, 0, 0, 0, time.UTC)
	c.produce(&sarama.ProducerMessage{
		Topic: topic, Partition: 1, Timestamp: ts,
		Key:   sarama.StringEncoder("k1"),
		Value: sarama.StringEncoder(`{"n":1}`),
		Headers: []sarama.RecordHeader{
			{Key: []byte("id"), Value: []byte("ev-1")},
			{Key: []byte("traceparent"), Value: []byte("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")},
		},
	})
	s := c.open(c.config(uniq("g"), topic))
	assert.Equal(t, "kafka", s.MessagingSystem())

	d := receive(t, s)
	m := d.Message()
	assert.Equal(t, "", m.ID, "Kafka has no native id; the core reads the id header")
	tid := c.topicID(topic)
	require.NotEmpty(t, tid, "kfake has topic ids")
	assert.Equal(t, topic+"/1/0@"+tid, m.FallbackID, "topic/partition/offset@topic-id")
	assert.Equal(t, topic+"/1", m.Stream)
	assert.Equal(t, topic, m.Topic)
	assert.Equal(t, int32(1), m.Partition)
	assert.Equal(t, int64(0), m.Offset)
	assert.True(t, m.Timestamp.Equal(ts), "timestamp %v", m.Timestamp)
	assert.Equal(t, []byte("k1"), m.Key)
	assert.Equal(t, []byte(`{"n":1}`), m.Value)
	assert.Equal(t, map[string]string{
		"id":          "ev-1",
		"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
	}, m.Headers)
	assert.False(t, m.Redelivered, "Kafka keeps no delivery count")
	require.NoError(t, d.Context().Err())
	require.NoError(t, d.Ack(context.Background()))

	c.produce(msg(topic, 1, "second"))
	d2 := receive(t, s)
	assert.Equal(t, int64(1), d2.Message().Offset)
	assert.Equal(t, topic+"/1/1@"+tid, d2.Message().FallbackID)
	assert.Same(t, d.Context(), d2.Context(), "one context per partition claim")
}

func TestOffsetsCommittedOnlyForAckedRecords(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 3)
	var msgs []*sarama.ProducerMessage
	for p := range int32(3) {
		for i := range 5 {
			msgs = append(msgs, msg(topic, p, fmt.Sprintf("p%d-%d", p, i)))
		}
	}
	c.produce(msgs...)
	group := uniq("g")
	s := c.open(c.config(group, topic))

	// Per partition: ack the first three records in order, then the fifth;
	// the fourth stays unsettled, so the mark stops at offset 3.
	byPart := map[int32][]*delivery{}
	for _, d := range receiveN(t, s, 15) {
		p := d.Message().Partition
		byPart[p] = append(byPart[p], d)
	}
	for p, ds := range byPart {
		require.Len(t, ds, 5, "partition %d", p)
		for i, d := range ds {
			require.Equal(t, int64(i), d.Message().Offset, "offset order within partition %d", p)
		}
		for _, i := range []int{0, 1, 2, 4} {
			require.NoError(t, ds[i].Ack(context.Background()))
		}
	}
	// Periodic commit: visible before Close.
	require.Eventually(t, func() bool {
		got := c.committed(group, topic, 3)
		return got[0] == 3 && got[1] == 3 && got[2] == 3
	}, 10*time.Second, 50*time.Millisecond)

	require.NoError(t, s.Close())
	require.NoError(t, s.Close(), "a second Close returns the first one's result")
	assert.Equal(t, map[int32]int64{0: 3, 1: 3, 2: 3}, c.committed(group, topic, 3))
	for _, ds := range byPart {
		assert.Error(t, ds[3].Context().Err(), "Close ends the unsettled deliveries")
		assert.ErrorIs(t, ds[3].Ack(context.Background()), ErrRevoked)
	}
	_, err := s.Receive(context.Background())
	assert.ErrorIs(t, err, consumer.ErrSourceClosed)

	// A restart resumes at the first unacked record of each partition.
	s2 := c.open(c.config(group, topic))
	seen := map[int32][]int64{}
	for _, d := range receiveN(t, s2, 6) {
		m := d.Message()
		seen[m.Partition] = append(seen[m.Partition], m.Offset)
		require.NoError(t, d.Ack(context.Background()))
	}
	assert.Equal(t, map[int32][]int64{0: {3, 4}, 1: {3, 4}, 2: {3, 4}}, seen)
	require.NoError(t, s2.Close())
	assert.Equal(t, map[int32]int64{0: 5, 1: 5, 2: 5}, c.committed(group, topic, 3))
}

func TestAckOutOfOrderMarksOnlySettledPrefix(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	c.produce(msg(topic, 0, "a"), msg(topic, 0, "b"), msg(topic, 0, "c"))
	group := uniq("g")
	s := c.open(c.config(group, topic))
	ds := receiveN(t, s, 3)
	require.NoError(t, ds[2].Ack(context.Background()))
	require.NoError(t, ds[1].Ack(context.Background()))
	require.NoError(t, ds[1].Ack(context.Background()), "a second Ack is a no-op")
	// Nothing is marked while offset 0 is unsettled: give the periodic
	// commit a few intervals to show it would not commit anything.
	require.Never(t, func() bool { return c.committed(group, topic, 1)[0] >= 0 }, 500*time.Millisecond, 50*time.Millisecond)
	require.NoError(t, ds[0].Ack(context.Background()))
	require.Eventually(t, func() bool { return c.committed(group, topic, 1)[0] == 3 }, 10*time.Second, 50*time.Millisecond)
}

// A member joins while the first member holds an unacked delivery: the
// revoke waits for it, and its Ack is in the final commit of the old
// session, so the new owner does not receive it again.
func TestRevokeWaitsForInFlightAck(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 2)
	c.produce(msg(topic, 0, "a0"), msg(topic, 1, "b0"))
	group := uniq("g")
	a := c.open(c.config(group, topic))
	held := receiveN(t, a, 2) // offset 0 of each partition
	for _, d := range held {
		require.Equal(t, int64(0), d.Message().Offset)
	}
	c.produce(msg(topic, 0, "a1"), msg(topic, 1, "b1"))

	b := c.open(c.config(group, topic))
	bctx, bcancel := context.WithCancel(context.Background())
	defer bcancel()
	bGot := make(chan *delivery, 10)
	go func() {
		for {
			d, err := b.Receive(bctx)
			if err != nil {
				return
			}
			bGot <- d.(*delivery)
		}
	}()

	// The rebalance cannot complete while a's deliveries are unsettled.
	require.Never(t, func() bool { return len(bGot) > 0 }, time.Second, 50*time.Millisecond)
	for _, d := range held {
		require.NoError(t, d.Context().Err(), "within the revoke bound the delivery stays valid")
		require.NoError(t, d.Ack(context.Background()))
	}

	// b gets one partition; a keeps or regains the other. Whatever b
	// receives starts after what a acked.
	select {
	case d := <-bGot:
		assert.Equal(t, int64(1), d.Message().Offset, "b resumes after a's acked record")
		require.NoError(t, d.Ack(context.Background()))
	case <-time.After(20 * time.Second):
		t.Fatal("b received nothing after the rebalance")
	}
	for _, d := range held {
		assert.Error(t, d.Context().Err(), "the old claim's context ends with the revoke")
	}
}

// A member that does not settle within RevokeTimeout has its deliveries
// abandoned: their contexts end, Ack marks nothing, and the new owner
// receives the record again.
func TestRevokeTimeoutAbandonsUnsettled(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	c.produce(msg(topic, 0, "a0"), msg(topic, 0, "a1"))
	group := uniq("g")
	cfg := c.config(group, topic)
	cfg.RevokeTimeout = 300 * time.Millisecond
	a := c.open(cfg)
	d := receive(t, a)
	require.Equal(t, int64(0), d.Message().Offset)

	// A second member joins; whichever member gets the partition, the
	// unsettled delivery of the old generation is abandoned.
	b := c.open(cfg)
	bctx, bcancel := context.WithCancel(context.Background())
	defer bcancel()
	bGot := make(chan *delivery, 10)
	go func() {
		for {
			d, err := b.Receive(bctx)
			if err != nil {
				return
			}
			bGot <- d.(*delivery)
		}
	}()

	select {
	case <-d.Context().Done():
	case <-time.After(20 * time.Second):
		t.Fatal("the revoked delivery's context did not end")
	}
	err := d.Ack(context.Background())
	require.ErrorIs(t, err, ErrRevoked)
	require.ErrorIs(t, d.DeadLetter(context.Background(), &consumer.DeadLetter{Kind: consumer.KindHandler}), ErrRevoked)

	// Offset 0 is delivered again, to b or to a.
	actx, acancel := context.WithCancel(context.Background())
	defer acancel()
	aGot := make(chan *delivery, 10)
	go func() {
		for {
			d, err := a.Receive(actx)
			if err != nil {
				return
			}
			aGot <- d.(*delivery)
		}
	}()
	var again *delivery
	select {
	case again = <-aGot:
	case again = <-bGot:
	case <-time.After(20 * time.Second):
		t.Fatal("the abandoned record was not delivered again")
	}
	assert.Equal(t, int64(0), again.Message().Offset)
	assert.NotSame(t, d.Context(), again.Context(), "a new claim has a new context")
	// The old delivery's Ack, even now that the partition is owned again
	// (possibly by the same member), marks nothing in the new generation.
	require.ErrorIs(t, d.Ack(context.Background()), ErrRevoked)
	require.Never(t, func() bool { return c.committed(group, topic, 1)[0] >= 0 }, 500*time.Millisecond, 50*time.Millisecond,
		"nothing is committed for the abandoned record until its redelivery is acked")
	require.NoError(t, again.Ack(context.Background()))
	require.Eventually(t, func() bool { return c.committed(group, topic, 1)[0] == 1 }, 10*time.Second, 20*time.Millisecond)
}

func TestDeadLetterCopiesRecord(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 1)
	value := []byte{0xff, 0x00, '{', 'b', 'a', 'd'}
	c.produce(&sarama.ProducerMessage{
		Topic: topic, Partition: 0,
		Key:   sarama.ByteEncoder("key-1"),
		Value: sarama.ByteEncoder(value),
		Headers: []sarama.RecordHeader{
			{Key: []byte("id"), Value: []byte("ev-1")},
			{Key: []byte("x-tag"), Value: []byte("one")},
			{Key: []byte("x-tag"), Value: []byte("two")},
			{Key: []byte("traceparent"), Value: []byte("00-11111111111111111111111111111111-2222222222222222-01")},
		},
	})
	s := c.open(c.config(uniq("g"), topic))
	d := receive(t, s)
	failedAt := time.Date(2026, 11, 22, 1, 2, 3, 0, time.UTC)
	dl := &consumer.DeadLetter{
		Kind: consumer.KindHandler, Error: "boom", Consumer: "orders-svc", EventID: "ev-1", EventType: "order.created",
		Attempts: 3, FailedAt: failedAt, TraceParent: "00-33333333333333333333333333333333-4444444444444444-01",
	}
	require.NoError(t, d.DeadLetter(context.Background(), dl))
	require.NoError(t, d.Ack(context.Background()))

	recs := c.readAll(topic + ".dlq")
	require.Len(t, recs, 1)
	r := recs[0]
	assert.Equal(t, value, r.Value, "value byte-identical")
	assert.Equal(t, []byte("key-1"), r.Key)
	var tags []string
	got := map[string]string{}
	for _, h := range r.Headers {
		if string(h.Key) == "x-tag" {
			tags = append(tags, string(h.Value))
		}
		got[string(h.Key)] = string(h.Value)
	}
	assert.Equal(t, []string{"one", "two"}, tags, "original headers kept, repeated keys too")
	assert.Equal(t, map[string]string{
		"id":                             "ev-1",
		"x-tag":                          "two",
		"traceparent":                    dl.TraceParent,
		consumer.HeaderOriginalTopic:     topic,
		consumer.HeaderOriginalPartition: "0",
		consumer.HeaderOriginalOffset:    "0",
		consumer.HeaderOriginalTimestamp: d.Message().Timestamp.UTC().Format(time.RFC3339Nano),
		consumer.HeaderConsumer:          "orders-svc",
		consumer.HeaderEventID:           "ev-1",
		consumer.HeaderEventType:         "order.created",
		consumer.HeaderAttempts:          "3",
		consumer.HeaderErrorKind:         "handler",
		consumer.HeaderErrorMessage:      "boom",
		consumer.HeaderFailedAt:          failedAt.Format(time.RFC3339Nano),
		consumer.HeaderFallbackID:        d.Message().FallbackID,
	}, got)
	assert.Regexp(t, "^"+topic+"/0/0@.+", got[consumer.HeaderFallbackID])
	n := 0
	for _, h := range r.Headers {
		if string(h.Key) == "traceparent" {
			n++
		}
	}
	assert.Equal(t, 1, n, "the consumer's traceparent replaces the original one")
}

func TestDeadLetterKeepsNullKeyAndEmptyValue(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 1)
	c.produce(&sarama.ProducerMessage{Topic: topic, Partition: 0, Value: sarama.ByteEncoder{}})
	s := c.open(c.config(uniq("g"), topic))
	d := receive(t, s)
	require.NoError(t, d.DeadLetter(context.Background(), &consumer.DeadLetter{Kind: consumer.KindDecode, FailedAt: time.Now()}))
	recs := c.readAll(topic + ".dlq")
	require.Len(t, recs, 1)
	assert.Nil(t, recs[0].Key)
	assert.Empty(t, recs[0].Value)
}

func TestDeadLetterCustomTopicAndMissingTopic(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	c.createTopic("dead-"+topic, 1)
	c.produce(msg(topic, 0, "x"), msg(topic, 0, "y"))

	cfg := c.config(uniq("g"), topic)
	cfg.DeadLetter.Topic = func(t string) string { return "dead-" + t }
	s := c.open(cfg)
	d := receive(t, s)
	require.NoError(t, d.DeadLetter(context.Background(), &consumer.DeadLetter{Kind: consumer.KindDecode, FailedAt: time.Now()}))
	require.Len(t, c.readAll("dead-"+topic), 1)
	require.NoError(t, d.Ack(context.Background()))
	require.NoError(t, s.Close())

	// The default <topic>.dlq does not exist: Open says so.
	cfg = c.config(uniq("g"), topic)
	cfg.DeadLetter.Create = false
	_, err := Open(t.Context(), cfg)
	require.ErrorIs(t, err, ErrDeadLetterTopicMissing)
	assert.Contains(t, err.Error(), topic+".dlq")
}

func TestLagGauge(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 2)
	var msgs []*sarama.ProducerMessage
	for i := range 10 {
		msgs = append(msgs, msg(topic, 0, strconv.Itoa(i)))
	}
	c.produce(msgs...)

	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	cfg := c.config(uniq("g"), topic)
	cfg.MeterProvider = mp
	s := c.open(cfg)
	receiveN(t, s, 3)

	lagOf := func() map[string]int64 {
		var rm metricdata.ResourceMetrics
		require.NoError(t, reader.Collect(context.Background(), &rm))
		out := map[string]int64{}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if m.Name != LagMetricName {
					continue
				}
				for _, dp := range m.Data.(metricdata.Gauge[int64]).DataPoints {
					tp, _ := dp.Attributes.Value("messaging.destination.name")
					p, _ := dp.Attributes.Value("messaging.destination.partition.id")
					g, _ := dp.Attributes.Value("messaging.consumer.group.name")
					assert.Equal(t, cfg.Group, g.AsString())
					out[tp.AsString()+"/"+p.AsString()] = dp.Value
				}
			}
		}
		return out
	}
	require.Eventually(t, func() bool { return lagOf()[topic+"/0"] == 7 }, 10*time.Second, 50*time.Millisecond,
		"10 records, 3 received: lag 7; got %v", lagOf())
	_, reported := lagOf()[topic+"/1"]
	assert.False(t, reported, "an empty partition without a committed offset has no known position")

	require.NoError(t, s.Close())
	assert.Empty(t, lagOf(), "a closed source reports no lag")
}

// A consumed topic that does not exist yet is not fatal: the source keeps
// trying to join, and delivers once the topic exists.
func TestMissingTopicRetriedUntilCreated(t *testing.T) {
	c := newCluster(t)
	topic := uniq("later")
	var warns atomicCounter
	cfg := c.config(uniq("g"), topic)
	cfg.Logger = warns.logger()
	s := c.open(cfg)
	got := make(chan *delivery, 1)
	errs := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		d, err := s.Receive(ctx)
		if err != nil {
			errs <- err
			return
		}
		got <- d.(*delivery)
	}()
	require.Eventually(t, func() bool { return warns.n.Load() > 0 }, 20*time.Second, 10*time.Millisecond,
		"the failed join is logged")
	c.createTopic(topic, 1)
	c.produce(msg(topic, 0, "first"))
	select {
	case d := <-got:
		assert.Equal(t, []byte("first"), d.Message().Value)
	case err := <-errs:
		t.Fatalf("Receive failed: %v", err)
	}
}

// lineCounter is a log writer that counts the lines containing match and
// calls then once the count reaches at.
type lineCounter struct {
	mu    sync.Mutex
	match string
	at    int
	then  func()
	n     int
}

func (l *lineCounter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if strings.Contains(string(p), l.match) {
		l.n++
		if l.n == l.at {
			l.then()
		}
	}
	return len(p), nil
}

func (l *lineCounter) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.n
}

// A session timeout outside the brokers' bounds is a configuration error
// that only the group coordinator finds: every join is refused. Receive
// fails with an error naming the field, as Open does for the errors it can
// see, instead of retrying the join forever.
func TestSessionTimeoutRefusedByTheBrokerFailsReceive(t *testing.T) {
	c := newCluster(t, kfake.GroupMinSessionTimeout(3*time.Second))
	topic := uniq("orders")
	c.createTopic(topic, 1)
	cfg := c.config(uniq("g"), topic) // SessionTimeout 2 s
	s := c.open(cfg)
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	_, err := s.Receive(ctx)
	require.Error(t, err)
	assert.NotErrorIs(t, err, context.DeadlineExceeded, "Receive gave up on the join, not on its context")
	assert.ErrorIs(t, err, sarama.ErrInvalidSessionTimeout)
	assert.Contains(t, err.Error(), "Config.SessionTimeout")
	_, err = s.Receive(ctx)
	assert.ErrorIs(t, err, sarama.ErrInvalidSessionTimeout, "the error is for good")
}

// A static member (Sarama.Consumer.Group.InstanceId) replaced by another
// that joined with the same instance id is fenced by the coordinator for
// good: it retried every join without end, Receive blocking for ever while
// the warnings said "consuming failed" (two replicas given one id, or an
// old instance left running beside its replacement). Receive fails with an
// error naming the field, as Kafka's own consumer stops; the other member
// consumes on.
func TestFencedStaticMemberFailsReceive(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 2)
	c.produce(msg(topic, 0, "a"), msg(topic, 1, "b"))
	open := func() *Source {
		cfg := c.config(group, topic)
		cfg.Sarama.Consumer.Group.InstanceId = "billing-1"
		return c.open(cfg)
	}
	old := open()
	require.NoError(t, receive(t, old).Ack(t.Context()))
	replacement := open()
	require.NoError(t, receive(t, replacement).Ack(t.Context()), "the replacement consumes")

	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	var err error
	for err == nil {
		var d consumer.Delivery
		if d, err = old.Receive(ctx); err == nil {
			_ = d.Ack(ctx)
		}
	}
	assert.NotErrorIs(t, err, context.DeadlineExceeded, "Receive gave up on the fenced member, not on its context")
	assert.ErrorIs(t, err, sarama.ErrFencedInstancedId)
	assert.Contains(t, err.Error(), "Consumer.Group.InstanceId")
	_, err = old.Receive(ctx)
	assert.ErrorIs(t, err, sarama.ErrFencedInstancedId, "the error is for good")
}

// Topic names Kafka refuses (it allows ASCII letters, digits, '.', '_' and
// '-', at most 249 of them, and neither "." nor "..") are configuration
// errors: Open names the field at once, before it reaches for a broker,
// instead of failing later with a misleading error (a dead-letter topic
// "does not exist; create it", a topic that can never be joined).
func TestOpenRefusesTopicNamesKafkaRefuses(t *testing.T) {
	long := strings.Repeat("t", 249)
	for _, tc := range []struct {
		name  string
		edit  func(*Config)
		field string
	}{
		{"slash", func(c *Config) { c.Topics = []string{"t", "orders/eu"} }, "Config.Topics[1]"},
		{"space", func(c *Config) { c.Topics = []string{"orders eu"} }, "Config.Topics[0]"},
		{"at sign", func(c *Config) { c.Topics = []string{"orders@eu"} }, "Config.Topics[0]"},
		{"dot", func(c *Config) { c.Topics = []string{"."} }, "Config.Topics[0]"},
		{"too long", func(c *Config) { c.Topics = []string{long + "x"} }, "Config.Topics[0]"},
		{"dead-letter name too long", func(c *Config) { c.Topics = []string{long} }, "Config.DeadLetter.Topic"},
		{"dead-letter name with a colon", func(c *Config) { c.DeadLetter.Topic = func(t string) string { return "dlq:" + t } }, "Config.DeadLetter.Topic"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"}, Logger: testLogger()}
			tc.edit(&cfg)
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			defer cancel()
			s, err := Open(ctx, cfg)
			require.Error(t, err)
			assert.Nil(t, s)
			assert.NotErrorIs(t, err, context.DeadlineExceeded, "refused at once")
			assert.Contains(t, err.Error(), tc.field)
		})
	}
	cfg := Config{Topics: []string{long[:245] + "-._A9"}}.withDefaults()
	require.ErrorContains(t, cfg.validate(), "Config.Brokers", "a name of every allowed character and the longest length passes")
}

// A duration in the wrong unit (CloseTimeout: 10, meant as seconds, is 10
// ns) was accepted: every Close gave up at once, leaving the group without
// its final commit; RevokeTimeout abandoned every delivery in flight at
// each rebalance; CommitInterval committed in a loop that held a core.
// Open refuses each at once, naming the field.
func TestOpenRefusesDurationsBelowAMillisecond(t *testing.T) {
	for name, set := range map[string]func(*Config, time.Duration){
		"Config.CommitInterval": func(c *Config, d time.Duration) { c.CommitInterval = d },
		"Config.RevokeTimeout":  func(c *Config, d time.Duration) { c.RevokeTimeout = d },
		"Config.CloseTimeout":   func(c *Config, d time.Duration) { c.CloseTimeout = d },
	} {
		t.Run(name, func(t *testing.T) {
			for _, d := range []time.Duration{10, time.Millisecond - 1} {
				cfg := Config{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"}, Logger: testLogger()}
				set(&cfg, d)
				ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
				s, err := Open(ctx, cfg)
				cancel()
				require.Error(t, err, "%v", d)
				assert.Nil(t, s)
				assert.NotErrorIs(t, err, context.DeadlineExceeded, "refused at once")
				assert.Contains(t, err.Error(), name, "%v", d)
			}
			cfg := Config{Topics: []string{"t"}}
			set(&cfg, time.Millisecond)
			cfg = cfg.withDefaults()
			require.ErrorContains(t, cfg.validate(), "Config.Brokers", "a millisecond passes")
		})
	}
}

// A reconnect backoff in the wrong unit (ReconnectMaxBackoff: 5, meant as
// seconds, is 5 ns) was accepted while the other durations below a
// millisecond are refused: through an outage Open's retries and the
// group's rejoins dialled back to back, a warning logged for each, and
// Open with such a backoff against no broker ran until its context ended.
// Open refuses each at once, naming the field.
func TestOpenRefusesReconnectBackoffsBelowAMillisecond(t *testing.T) {
	for name, set := range map[string]func(*Config, time.Duration){
		"Config.ReconnectMinBackoff": func(c *Config, d time.Duration) { c.ReconnectMinBackoff = d },
		"Config.ReconnectMaxBackoff": func(c *Config, d time.Duration) { c.ReconnectMinBackoff, c.ReconnectMaxBackoff = time.Millisecond, d },
	} {
		t.Run(name, func(t *testing.T) {
			for _, d := range []time.Duration{5, time.Millisecond - 1} {
				cfg := Config{Brokers: []string{"127.0.0.1:1"}, Group: "g", Topics: []string{"t"}, Logger: testLogger()}
				set(&cfg, d)
				ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
				s, err := Open(ctx, cfg)
				cancel()
				require.Error(t, err, "%v", d)
				assert.Nil(t, s)
				assert.NotErrorIs(t, err, context.DeadlineExceeded, "refused at once")
				assert.Contains(t, err.Error(), name+" "+d.String()+" is below a millisecond", "%v", d)
			}
			cfg := Config{Topics: []string{"t"}}
			set(&cfg, time.Millisecond)
			cfg = cfg.withDefaults()
			require.ErrorContains(t, cfg.validate(), "Config.Brokers", "a millisecond passes")
		})
	}
}

// A broker address without a port can never be dialled: Open names the
// field at once instead of retrying it as an unreachable broker until its
// context ends.
func TestOpenRefusesBrokerAddressesWithoutPort(t *testing.T) {
	for i, brokers := range [][]string{{"localhost"}, {"127.0.0.1:9092", "kafka-2.internal"}, {"[::1]"}, {"localhost:"}} {
		t.Run(strings.Join(brokers, ","), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			defer cancel()
			sc := sarama.NewConfig()
			sc.Net.DialTimeout = 100 * time.Millisecond
			s, err := Open(ctx, Config{Brokers: brokers, Group: "g", Topics: []string{"t"}, Sarama: sc, Logger: testLogger()})
			require.Error(t, err)
			assert.Nil(t, s)
			assert.NotErrorIs(t, err, context.DeadlineExceeded, "refused at once")
			assert.Contains(t, err.Error(), fmt.Sprintf("Config.Brokers[%d]", len(brokers)-1), "case %d", i)
		})
	}
}

// With sarama's Consumer.Group.ResetInvalidOffsets off, a partition whose
// committed offset is out of range (retention deleted the records while
// the group was away) is never claimed: each session ends as soon as it
// began, and the whole group rebalances again and again (57 warnings in
// 5 s on kfake) while that partition stays stuck. Open refuses the
// setting, naming it.
func TestOpenRefusesResetInvalidOffsetsOff(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	cfg := c.config(uniq("g"), topic)
	cfg.Sarama.Consumer.Group.ResetInvalidOffsets = false
	s, err := Open(t.Context(), cfg)
	if s != nil {
		_ = s.Close()
	}
	require.Error(t, err)
	assert.Contains(t, err.Error(), "Config.Sarama.Consumer.Group.ResetInvalidOffsets")
}
