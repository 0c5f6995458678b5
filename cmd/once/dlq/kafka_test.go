package dlq_test

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

func kmsg(topic string, p int32, id string, value []byte) *sarama.ProducerMessage {
	m := &sarama.ProducerMessage{Topic: topic, Partition: p, Key: sarama.StringEncoder("k-" + id), Value: sarama.ByteEncoder(value)}
	if id != "" {
		m.Headers = []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(id)}, {Key: []byte("x-origin"), Value: []byte("test")}}
	}
	return m
}

// kafkaPoison is the scenario both Kafka tests start from: a real consumer,
// broken, dead-letters records of kinds handler, panic, decode and
// id-conflict, two of them without a producer id (their id is
// topic/partition/offset); then the service is fixed, and one dead-lettered
// event is sent again and handled, before any replay.
type kafkaPoison struct {
	k       *testenv.Kafka
	topic   string
	svc     *testenv.Service
	q       *dlq.KafkaQueue
	sent    uint64   // deliveries the consumer must have settled so far
	want    []string // events that must end with exactly one effect
	idLess  []string // the fallback ids of the records without producer id
	deadAt0 int      // dead letters after the broken phase
}

func newKafkaPoison(t *testing.T) *kafkaPoison {
	k := testenv.NewKafka(t)
	topic := testenv.Uniq("orders")
	k.CreateTopic(topic, 2)
	k.CreateTopic(topic+".dlq", 1)
	pool, _ := pgtest.Schema(t)
	s := &kafkaPoison{k: k, topic: topic}
	msgs := []*sarama.ProducerMessage{
		kmsg(topic, 0, "ok-1", testenv.JSON(1, "ok")),
		kmsg(topic, 1, "ok-2", testenv.JSON(2, "ok")),
		kmsg(topic, 0, "fail-1", testenv.JSON(3, "fail")),
		kmsg(topic, 1, "fail-2", testenv.JSON(4, "fail")),
		kmsg(topic, 0, "panic-1", testenv.JSON(5, "panic")),
		kmsg(topic, 1, "legacy-1", append([]byte(testenv.LegacyPrefix), testenv.JSON(6, "ok")...)),
		kmsg(topic, 0, "", testenv.JSON(7, "fail")), // partition 0, offset 3
		kmsg(topic, 1, "", testenv.JSON(8, "fail")), // partition 1, offset 3
		kmsg(topic, 0, "always-1", testenv.JSON(9, "always")),
		kmsg(topic, 1, "fail-3", testenv.JSON(10, "fail")),
		kmsg(topic, 0, "ok-1", testenv.JSON(99, "ok")), // same id, other payload: id-conflict
	}
	k.Produce(msgs...)
	s.sent = uint64(len(msgs))
	s.idLess = []string{topic + "/0/3", topic + "/1/3"}
	s.want = append([]string{"ok-1", "ok-2", "fail-1", "fail-2", "panic-1", "legacy-1", "fail-3"}, s.idLess...)

	s.svc = testenv.StartService(t, pool, k.Source(testenv.Uniq("g"), topic), "billing")
	s.svc.WaitSettled(t, s.sent)
	st := s.svc.C.Stats()
	require.EqualValues(t, 9, st.DeadLettered, "%+v", st)
	s.deadAt0 = 9

	var err error
	s.q, err = dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: topic + ".dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)

	s.svc.Broken.Store(false)
	k.Produce(kmsg(topic, 1, "fail-3", testenv.JSON(10, "fail"))) // sent again by its producer, handled
	s.sent++
	s.svc.WaitSettled(t, s.sent)
	return s
}

func (s *kafkaPoison) replay(t *testing.T, opts dlq.ReplayOptions) dlq.Report {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := s.q.Replay(ctx, dlq.Filter{Consumer: "billing"}, opts)
	require.NoError(t, err)
	s.sent += uint64(rep.Replayed)
	return rep
}

// Replaying every dead letter twice in a row, then twice at once, leaves
// one effect per event: for records with producer ids, records whose id
// was their Kafka position, a record handled meanwhile, and a record that
// fails again (dead-lettered again, with its redrive count).
func TestKafkaReplayTwiceAndConcurrentlyHasOneEffectPerEvent(t *testing.T) {
	s := newKafkaPoison(t)

	dry := s.replay(t, dlq.ReplayOptions{DryRun: true})
	assert.Equal(t, 9, dry.Selected)
	assert.Zero(t, dry.Replayed)
	assert.Equal(t, 1, dry.Skipped, "the id-conflict is not replayable")
	assert.Empty(t, s.svc.Effects(t)["fail-1"], "a dry run publishes nothing")

	first := s.replay(t, dlq.ReplayOptions{By: "alice"})
	assert.Equal(t, 8, first.Replayed)
	s.svc.WaitSettled(t, s.sent)
	second := s.replay(t, dlq.ReplayOptions{By: "alice"})
	assert.GreaterOrEqual(t, second.Replayed, 8)

	var wg sync.WaitGroup
	reps := make([]dlq.Report, 2)
	for i := range reps {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			rep, err := s.q.Replay(ctx, dlq.Filter{Consumer: "billing"}, dlq.ReplayOptions{By: "bob-" + strconv.Itoa(i)})
			assert.NoError(t, err)
			reps[i] = rep
		})
	}
	wg.Wait()
	s.sent += uint64(reps[0].Replayed + reps[1].Replayed)
	s.svc.WaitSettled(t, s.sent)

	effects := s.svc.Effects(t)
	for _, id := range s.want {
		assert.Equal(t, 1, effects[id], "event %s", id)
	}
	assert.Len(t, effects, len(s.want), "no other effect: %v", effects)
	assert.Zero(t, effects["always-1"])

	// The record that fails on every redrive came back with its history.
	recs, err := dlq.Collect(context.Background(), s.q, dlq.Filter{EventID: "always-1"})
	require.NoError(t, err)
	require.Greater(t, len(recs), 1)
	maxCount := 0
	for _, r := range recs[1:] {
		assert.Equal(t, string(consumer.KindHandler), r.Kind())
		assert.NotEmpty(t, r.Header(consumer.HeaderRedrivenAt))
		assert.Equal(t, "always-1", r.Header(consumer.HeaderRedriveEventID))
		assert.Equal(t, "test", r.Header("x-origin"), "original headers travel")
		maxCount = max(maxCount, r.RedriveCount())
	}
	assert.GreaterOrEqual(t, maxCount, 2, "a redrive of a redriven record counts on")
	assert.Zero(t, recs[0].RedriveCount())
}

// A record whose id was its position (topic/partition/offset) keeps that id
// when redriven to another offset, so replaying it again is a duplicate of
// its first redrive, and it has one effect.
func TestKafkaReplayOfRecordsWithoutProducerIDIsDeduplicated(t *testing.T) {
	s := newKafkaPoison(t)
	idLess := dlq.Filter{EventID: s.topic + "/*"}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for round := range 3 {
		before := s.svc.C.Stats()
		rep, err := s.q.Replay(ctx, idLess, dlq.ReplayOptions{})
		require.NoError(t, err)
		require.Equal(t, 2, rep.Replayed)
		s.sent += 2
		s.svc.WaitSettled(t, s.sent)
		after := s.svc.C.Stats()
		if round == 0 {
			assert.EqualValues(t, 2, after.Handled-before.Handled, "the first redrive is handled")
		} else {
			assert.EqualValues(t, 2, after.Duplicates-before.Duplicates, "a later redrive is a duplicate")
		}
	}
	effects := s.svc.Effects(t)
	for _, id := range s.idLess {
		assert.Equal(t, 1, effects[id], "event %s", id)
	}
	recs, err := dlq.Collect(ctx, s.q, idLess)
	require.NoError(t, err)
	assert.Len(t, recs, 2, "the redriven records were not dead-lettered again")
}

// Reading the dead-letter topic commits nothing and creates no group; the
// records, their headers and bytes are the copies the consumer wrote.
func TestKafkaBrowseShowsTheDeadLetters(t *testing.T) {
	s := newKafkaPoison(t)
	recs, err := dlq.Collect(context.Background(), s.q, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, recs, s.deadAt0)
	kinds := map[string]int{}
	for i, r := range recs {
		kinds[r.Kind()]++
		assert.Equal(t, i+1, r.Position)
		assert.Equal(t, "0:"+strconv.Itoa(i), r.Ref)
		assert.Equal(t, "billing", r.Consumer())
		assert.Equal(t, s.topic, r.Destination())
		assert.False(t, r.FailedAt().IsZero())
	}
	assert.Equal(t, map[string]int{"handler": 6, "panic": 1, "decode": 1, "id-conflict": 1}, kinds)

	legacy, err := dlq.Collect(context.Background(), s.q, dlq.Filter{Kinds: []string{"decode"}})
	require.NoError(t, err)
	require.Len(t, legacy, 1)
	assert.Equal(t, "legacy-1", legacy[0].EventID())
	assert.Equal(t, append([]byte(testenv.LegacyPrefix), testenv.JSON(6, "ok")...), legacy[0].Value)
	assert.Equal(t, []byte("k-legacy-1"), legacy[0].Key)

	found, err := dlq.Collect(context.Background(), s.q, dlq.Filter{Search: "REJECTED event 4"})
	require.NoError(t, err)
	require.Len(t, found, 1)
	assert.Equal(t, "fail-2", found[0].EventID())

	admin, err := sarama.NewClusterAdmin(s.k.Addrs, testenv.Sarama())
	require.NoError(t, err)
	defer admin.Close()
	groups, err := admin.ListConsumerGroups()
	require.NoError(t, err)
	assert.Len(t, groups, 1, "only the service's group exists: %v", groups)
}

// A base configuration made for a transactional producer (Transaction.ID
// set) still replays: the redrive producer is idempotent, not
// transactional, which would refuse every send made outside a transaction.
func TestKafkaReplayWithATransactionalBaseConfig(t *testing.T) {
	k := testenv.NewKafka(t)
	topic := testenv.Uniq("orders")
	k.CreateTopic(topic, 1)
	k.CreateTopic(topic+".dlq", 1)
	k.Produce(&sarama.ProducerMessage{Topic: topic + ".dlq", Value: sarama.StringEncoder("{}"), Headers: []sarama.RecordHeader{
		{Key: []byte(consumer.HeaderEventID), Value: []byte("e-1")},
		{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
		{Key: []byte(consumer.HeaderOriginalTopic), Value: []byte(topic)},
	}})
	base := testenv.Sarama()
	base.Producer.Idempotent = true
	base.Producer.RequiredAcks = sarama.WaitForAll
	base.Net.MaxOpenRequests = 1
	base.Producer.Transaction.ID = "billing-tx"
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: topic + ".dlq", Sarama: base})
	require.NoError(t, err)
	rep, err := q.Replay(context.Background(), dlq.Filter{}, dlq.ReplayOptions{})
	require.NoError(t, err)
	assert.Equal(t, 1, rep.Replayed)
	assert.Equal(t, "billing-tx", base.Producer.Transaction.ID, "the caller's configuration is not modified")
}

// replayTwoTwice replays the two dead letters of billing in topic's
// dead-letter topic twice, waiting after each replay until every one of svcs
// has settled the copies (settled deliveries before the first).
func replayTwoTwice(t *testing.T, k *testenv.Kafka, topic string, settled uint64, svcs ...*testenv.Service) {
	t.Helper()
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: topic + ".dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for round := 1; round <= 2; round++ {
		rep, err := q.Replay(ctx, dlq.Filter{Consumer: "billing"}, dlq.ReplayOptions{})
		require.NoError(t, err)
		require.Equal(t, 2, rep.Replayed, "round %d: %+v", round, rep)
		for _, svc := range svcs {
			svc.WaitSettled(t, settled+uint64(2*round))
		}
	}
}

// Two consumers read one topic, each identifying events its own way:
// billing by the producer's id header, else the record's position;
// shipping by a header of its own, so here always by position. A redrive
// of billing's dead letters reaches shipping too, which handled those
// records the first time: shipping skips the copies as duplicates under its
// own ids, and billing handles each once.
func TestKafkaReplayIsADuplicateForTheTopicsOtherConsumers(t *testing.T) {
	k := testenv.NewKafka(t)
	topic := testenv.Uniq("orders")
	k.CreateTopic(topic, 1)
	k.CreateTopic(topic+".dlq", 1)
	billingPool, _ := pgtest.Schema(t)
	shippingPool, _ := pgtest.Schema(t)
	billing := testenv.StartService(t, billingPool, k.Source(testenv.Uniq("billing"), topic), "billing")
	shipping := testenv.StartService(t, shippingPool, k.Source(testenv.Uniq("shipping"), topic), "shipping",
		func(c *consumer.Config) { c.Identify.IDHeaders = []string{"x-shipping-id"} })
	shipping.Broken.Store(false)
	k.Produce(
		kmsg(topic, 0, "fail-1", testenv.JSON(1, "fail")), // offset 0
		kmsg(topic, 0, "", testenv.JSON(2, "fail")),       // offset 1, no producer id
		kmsg(topic, 0, "ok-1", testenv.JSON(3, "ok")),     // offset 2
	)
	billing.WaitSettled(t, 3)
	shipping.WaitSettled(t, 3)
	require.EqualValues(t, 2, billing.C.Stats().DeadLettered)
	billing.Broken.Store(false)

	replayTwoTwice(t, k, topic, 3, billing, shipping)

	assert.Equal(t, map[string]int{"fail-1": 1, topic + "/0/1": 1, "ok-1": 1}, billing.Effects(t))
	assert.Equal(t, map[string]int{topic + "/0/0": 1, topic + "/0/1": 1, topic + "/0/2": 1}, shipping.Effects(t),
		"the redriven copies are shipping's duplicates")
	st := shipping.C.Stats()
	assert.EqualValues(t, 3, st.Handled, "%+v", st)
	assert.EqualValues(t, 4, st.Duplicates, "%+v", st)
}

// A consumer that keeps its Kafka offsets in PostgreSQL records a record
// without a producer id by its position alone, with no processed-events
// row. A redrive of another consumer's dead letter of that record is still
// its duplicate: it finds the first position done in its offsets table.
// Its own dead letter's redrive is handled, once, though that position is
// recorded done too (dead-lettered).
func TestKafkaReplayIsADuplicateForAConsumerWithOffsetsInTheDatabase(t *testing.T) {
	k := testenv.NewKafka(t)
	topic := testenv.Uniq("orders")
	k.CreateTopic(topic, 1)
	k.CreateTopic(topic+".dlq", 1)
	billingPool, _ := pgtest.Schema(t)
	shippingPool, _ := pgtest.Schema(t)
	billing := testenv.StartService(t, billingPool, k.Source(testenv.Uniq("billing"), topic), "billing")
	inDatabase := func(c *kafka.Config) { c.OffsetsInDatabase = true }
	shipping := testenv.StartService(t, shippingPool, k.Source(testenv.Uniq("shipping"), topic, inDatabase), "shipping")
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: topic + ".dlq", Sarama: testenv.Sarama()})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	settled := uint64(0)
	replayTwice := func(of string) {
		for range 2 {
			rep, err := q.Replay(ctx, dlq.Filter{Consumer: of}, dlq.ReplayOptions{})
			require.NoError(t, err)
			require.Equal(t, 1, rep.Replayed)
			settled++
			billing.WaitSettled(t, settled)
			shipping.WaitSettled(t, settled)
		}
	}

	// Shipping dead-letters offset 0; billing handles it.
	billing.Broken.Store(false)
	k.Produce(kmsg(topic, 0, "", testenv.JSON(1, "fail")), kmsg(topic, 0, "", testenv.JSON(2, "ok")))
	settled = 2
	billing.WaitSettled(t, settled)
	shipping.WaitSettled(t, settled)
	require.EqualValues(t, 1, shipping.C.Stats().DeadLettered)
	shipping.Broken.Store(false)
	replayTwice("shipping") // offsets 2 and 3

	// Billing dead-letters offset 4; shipping handles it by its position.
	billing.Broken.Store(true)
	k.Produce(kmsg(topic, 0, "", testenv.JSON(3, "fail")))
	settled++
	billing.WaitSettled(t, settled)
	shipping.WaitSettled(t, settled)
	require.EqualValues(t, 1, billing.C.Stats().DeadLettered)
	billing.Broken.Store(false)
	replayTwice("billing") // offsets 5 and 6

	want := map[string]int{topic + "/0/0": 1, topic + "/0/1": 1, topic + "/0/4": 1}
	assert.Equal(t, want, shipping.Effects(t), "billing's redrive is shipping's duplicate; its own is handled once")
	assert.Equal(t, want, billing.Effects(t))
}

// legacyEnvelope opens CloudEvents' structured JSON; while broken, it
// cannot open the values of the legacy format.
type legacyEnvelope struct{ broken *atomic.Bool }

func (e legacyEnvelope) Open(value []byte) (consumer.Opened, error) {
	rest, legacy := strings.CutPrefix(string(value), testenv.LegacyPrefix)
	if legacy && e.broken.Load() {
		return consumer.Opened{}, errors.New("legacy envelope not supported")
	}
	return consumer.JSONEnvelope{}.Open([]byte(rest))
}

// A record whose envelope could not be opened was dead-lettered before it
// had an id. It is replayable all the same: a consumer identifies the copy
// as it would have identified its first delivery (the envelope's id, else
// its first position), so replaying it twice has one effect, and a copy of
// an event its producer sent again is a duplicate.
func TestKafkaReplayOfRecordsDeadLetteredBeforeTheyHadAnID(t *testing.T) {
	k := testenv.NewKafka(t)
	topic := testenv.Uniq("orders")
	k.CreateTopic(topic, 1)
	k.CreateTopic(topic+".dlq", 1)
	pool, _ := pgtest.Schema(t)
	var broken atomic.Bool
	broken.Store(true)
	svc := testenv.StartService(t, pool, k.Source(testenv.Uniq("billing"), topic), "billing",
		func(c *consumer.Config) { c.Envelope = legacyEnvelope{&broken} })
	event := func(id string, n int) []byte {
		b, err := json.Marshal(map[string]any{"id": id, "data": testenv.Payload{N: n, Mode: "ok"}})
		require.NoError(t, err)
		return append([]byte(testenv.LegacyPrefix), b...)
	}
	k.Produce(kmsg(topic, 0, "", event("ev-1", 1)), kmsg(topic, 0, "", event("", 2))) // offsets 0 and 1
	svc.WaitSettled(t, 2)
	require.EqualValues(t, 2, svc.C.Stats().DeadLettered)
	broken.Store(false)
	k.Produce(kmsg(topic, 0, "", event("ev-1", 1))) // its producer sends ev-1 again: handled
	svc.WaitSettled(t, 3)

	replayTwoTwice(t, k, topic, 3, svc)
	assert.Equal(t, map[string]int{"ev-1": 1, topic + "/0/1": 1}, svc.Effects(t))
	st := svc.C.Stats()
	assert.EqualValues(t, 2, st.Handled, "%+v", st)
	assert.EqualValues(t, 3, st.Duplicates, "%+v", st)
}

// A base configuration tuned for a batching producer (Flush.Messages with
// no Frequency, shared for TLS and SASL) held the replay's copy, sent
// alone, for ever: the replay ran until its context ended and replayed
// nothing. The replay's producer clears the flush triggers on its copy.
func TestKafkaReplayWithABatchingBaseConfig(t *testing.T) {
	k := testenv.NewKafka(t)
	topic := testenv.Uniq("orders")
	k.CreateTopic(topic, 1)
	k.CreateTopic(topic+".dlq", 1)
	k.Produce(&sarama.ProducerMessage{Topic: topic + ".dlq", Value: sarama.StringEncoder("{}"), Headers: []sarama.RecordHeader{
		{Key: []byte(consumer.HeaderEventID), Value: []byte("e-1")},
		{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
		{Key: []byte(consumer.HeaderOriginalTopic), Value: []byte(topic)},
	}})
	base := testenv.Sarama()
	base.Producer.Flush.Messages = 1000
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: topic + ".dlq", Sarama: base})
	require.NoError(t, err)
	// Far longer than a replay of one record takes, far shorter than for ever.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rep, err := q.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{})
	require.NoError(t, err)
	assert.Equal(t, 1, rep.Replayed)
	assert.Equal(t, 1000, base.Producer.Flush.Messages, "the caller's configuration is not modified")
}
