package kafkaout

import (
	"errors"
	"fmt"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/outbox"
)

func TestNewRejectsBadConfig(t *testing.T) {
	_, err := New(Config{})
	require.ErrorContains(t, err, "Brokers is empty")
	_, err = New(Config{Brokers: []string{" "}})
	require.ErrorContains(t, err, "Brokers[0] is empty")
	old := sarama.NewConfig()
	old.Version = sarama.V0_10_2_0
	_, err = New(Config{Brokers: []string{"b:9092"}, Sarama: old})
	require.ErrorContains(t, err, "older than 0.11")
}

// The base configuration is copied, and what the guarantees rest on is set
// whatever it says.
func TestProducerConfigOverridesWhatTheGuaranteesNeed(t *testing.T) {
	base := sarama.NewConfig()
	base.Producer.RequiredAcks = sarama.NoResponse
	base.Net.MaxOpenRequests = 5
	base.Metadata.AllowAutoTopicCreation = true
	p, err := New(Config{Brokers: []string{"b:9092"}, Sarama: base})
	require.NoError(t, err)
	assert.True(t, p.sc.Producer.Idempotent)
	assert.Equal(t, sarama.WaitForAll, p.sc.Producer.RequiredAcks)
	assert.Equal(t, 1, p.sc.Net.MaxOpenRequests)
	assert.False(t, p.sc.Metadata.AllowAutoTopicCreation)
	assert.Equal(t, sarama.NoResponse, base.Producer.RequiredAcks, "the caller's configuration is not modified")
}

func TestMessageCarriesIDTypeAndHeaders(t *testing.T) {
	p, err := New(Config{Brokers: []string{"b:9092"}})
	require.NoError(t, err)
	m := p.message(outbox.Record{EventID: "e-1", Topic: "t", Key: []byte("k"), Type: "order.confirmed",
		Headers: map[string]string{"id": "spoofed", "traceparent": "00-x", "x": "y"}, Body: []byte("b")})
	h := map[string]string{}
	for _, rh := range m.Headers {
		h[string(rh.Key)] = string(rh.Value)
	}
	assert.Equal(t, map[string]string{"id": "e-1", "type": "order.confirmed", "traceparent": "00-x", "x": "y"}, h)
	key, _ := m.Key.Encode()
	assert.Equal(t, []byte("k"), key)
	assert.Nil(t, p.message(outbox.Record{Topic: "t"}).Key, "no key: a nil record key")
}

func TestCheckRefusesTooLargeAndTopicless(t *testing.T) {
	sc := sarama.NewConfig()
	sc.Producer.MaxMessageBytes = 1000
	p, err := New(Config{Brokers: []string{"b:9092"}, Sarama: sc})
	require.NoError(t, err)
	assert.NoError(t, p.Check(outbox.Record{Topic: "t", Body: make([]byte, 500)}))
	assert.True(t, outbox.IsRejected(p.Check(outbox.Record{Topic: "t", Body: make([]byte, 2000)})))
	assert.True(t, outbox.IsRejected(p.Check(outbox.Record{Body: []byte("x")})))
}

func TestRejectionClassification(t *testing.T) {
	for _, err := range []error{sarama.ErrUnknownTopicOrPartition, sarama.ErrMessageSizeTooLarge, sarama.ErrTopicAuthorizationFailed,
		sarama.ConfigurationError("too large"), fmt.Errorf("wrapped: %w", sarama.ErrInvalidTopic)} {
		assert.True(t, isRejection(err), "%v", err)
	}
	for _, err := range []error{sarama.ErrOutOfBrokers, sarama.ErrNotEnoughReplicas, sarama.ErrRequestTimedOut,
		sarama.ErrNotLeaderForPartition, errors.New("connection reset")} {
		assert.False(t, isRejection(err), "%v", err)
	}
}

// A base configuration made for a transactional producer (Transaction.ID
// set) gives a publisher all the same: the outbox's producer is idempotent,
// not transactional, and a transactional one refuses every send made
// outside a transaction, which the relay would retry without end.
func TestTransactionalBaseConfigPublishes(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
	require.NoError(t, err)
	defer kf.Close()
	base := sarama.NewConfig()
	base.Version = sarama.V2_8_0_0
	base.Producer.Idempotent = true
	base.Producer.RequiredAcks = sarama.WaitForAll
	base.Net.MaxOpenRequests = 1
	base.Producer.Transaction.ID = "billing-tx"
	p, err := New(Config{Brokers: kf.ListenAddrs(), Sarama: base})
	require.NoError(t, err)
	defer p.Close()
	errs := p.Publish(t.Context(), []outbox.Record{{EventID: "e-1", Topic: "orders", Body: []byte("b")}})
	assert.Nil(t, errs, "the record is confirmed: %v", errs)
	assert.Equal(t, "billing-tx", base.Producer.Transaction.ID, "the caller's configuration is not modified")
}

// A broker address without a port fails every dial: the relay would take it
// for a broker down and retry without end. New refuses it, as kafka.Open
// does.
func TestNewRefusesBrokerAddressesWithoutPort(t *testing.T) {
	for _, addr := range []string{"localhost", "[::1]", "host:", "host:0", "host:70000"} {
		_, err := New(Config{Brokers: []string{"localhost:9092", addr}})
		require.ErrorContains(t, err, "Config.Brokers[1]", addr)
	}
	_, err := New(Config{Brokers: []string{"localhost:9092", "[::1]:9093"}})
	require.NoError(t, err)
}

type staticToken string

func (s staticToken) Token() (*sarama.AccessToken, error) {
	return &sarama.AccessToken{Token: string(s)}, nil
}

// A broker that refuses the SASL settings (here a mechanism it does not
// offer): sarama reports it as "run out of available brokers" and drops
// the broker's answer, so the relay's log said nothing of why. The error
// names the broker and what it refused. (It stays an ordinary error, not
// a rejection of the records: the relay keeps them and retries.)
func TestPublishSaysWhatTheBrokerRefused(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"),
		kfake.EnableSASL(), kfake.Superuser("PLAIN", "svc", "s3cret-pw"))
	require.NoError(t, err)
	t.Cleanup(kf.Close)
	sc := sarama.NewConfig()
	sc.Metadata.Retry.Max = 0
	sc.Net.SASL.Enable = true
	sc.Net.SASL.Mechanism = sarama.SASLTypeOAuth
	sc.Net.SASL.TokenProvider = staticToken("s3cret-token")
	p, err := New(Config{Brokers: kf.ListenAddrs(), Sarama: sc})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	errs := p.Publish(t.Context(), []outbox.Record{{Seq: 1, EventID: "e-1", Topic: "orders", Body: []byte("{}")}})
	require.Len(t, errs, 1)
	require.Error(t, errs[0])
	t.Log(errs[0])
	assert.Contains(t, errs[0].Error(), "refused the SASL settings")
	assert.Contains(t, errs[0].Error(), kf.ListenAddrs()[0])
	assert.NotContains(t, errs[0].Error(), "s3cret")
	assert.False(t, outbox.IsRejected(errs[0]))
}

// One header for both the id and the type put two values under one key on
// every typed record, the type last: the consuming side, which takes a
// repeated header's last value, read the event type as the id, and every
// event of a type after the first was skipped as its duplicate. New
// refuses it.
func TestNewRefusesOneHeaderForTheIDAndTheType(t *testing.T) {
	for _, cfg := range []Config{
		{Brokers: []string{"b:9092"}, IDHeader: "type"},
		{Brokers: []string{"b:9092"}, TypeHeader: "id"},
		{Brokers: []string{"b:9092"}, IDHeader: "event", TypeHeader: "event"},
	} {
		_, err := New(cfg)
		require.Error(t, err, "%+v", cfg)
		assert.ErrorContains(t, err, "IDHeader")
	}
	_, err := New(Config{Brokers: []string{"b:9092"}, IDHeader: "event-id", TypeHeader: "event-type"})
	require.NoError(t, err)
}

// The key picks the partition, so that the rows of a key keep their order
// for the consumers: a base config whose partitioner ignores the key
// (random, round robin) spread them over partitions. New refuses it; a
// hash partitioner (the default) or a manual one is taken.
func TestNewRefusesAPartitionerThatIgnoresTheKey(t *testing.T) {
	for name, p := range map[string]sarama.PartitionerConstructor{
		"random": sarama.NewRandomPartitioner, "round robin": sarama.NewRoundRobinPartitioner,
	} {
		sc := sarama.NewConfig()
		sc.Version = sarama.V2_1_0_0
		sc.Producer.Partitioner = p
		_, err := New(Config{Brokers: []string{"b:9092"}, Sarama: sc})
		require.Error(t, err, name)
		assert.ErrorContains(t, err, "Partitioner", name)
	}
	for name, p := range map[string]sarama.PartitionerConstructor{
		"hash": sarama.NewHashPartitioner, "manual": sarama.NewManualPartitioner,
	} {
		sc := sarama.NewConfig()
		sc.Version = sarama.V2_1_0_0
		sc.Producer.Partitioner = p
		_, err := New(Config{Brokers: []string{"b:9092"}, Sarama: sc})
		require.NoError(t, err, name)
	}
}
