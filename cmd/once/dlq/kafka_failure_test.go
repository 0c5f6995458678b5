package dlq_test

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	kmsgs "github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
)

// A read whose fetch the broker answers "offset out of range" (retention,
// or a delete-records, removed records of the partition after the read
// looked them up) fails with that error: sarama then closes the partition
// consumer, and its closed channel of messages is not read as a record (a
// nil one).
func TestKafkaBrowseOfAnOffsetOutOfRangeFails(t *testing.T) {
	k := testenv.NewKafka(t)
	k.CreateTopic("orders.dlq", 1)
	for range 3 { // a batch each
		k.Produce(&sarama.ProducerMessage{Topic: "orders.dlq", Value: sarama.StringEncoder("{}")})
	}
	sc := testenv.Sarama()
	sc.Consumer.Fetch.Default = 1 // a batch a fetch
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: "orders.dlq", Sarama: sc})
	require.NoError(t, err)
	// The first fetch is answered; the next, made while the first record
	// is being handled, is out of range.
	fault := k.Cluster.Fault(kfake.Fault{Keys: []kmsgs.Key{kmsgs.Fetch}, Topic: "orders.dlq", Err: kerr.OffsetOutOfRange, Count: -1,
		When: func(req kmsgs.Request) bool {
			f := req.(*kmsgs.FetchRequest)
			return len(f.Topics) > 0 && len(f.Topics[0].Partitions) > 0 && f.Topics[0].Partitions[0].FetchOffset > 0
		}})
	// The records read before are handled slowly (a terminal, a pipe):
	// sarama has closed the partition consumer when the read looks for
	// the next one.
	for i := range 10 {
		func() {
			defer func() {
				if p := recover(); p != nil {
					t.Fatalf("read %d panicked: %v", i, p)
				}
			}()
			hits := fault.Hits()
			err := q.Browse(context.Background(), func(*dlq.Record) error {
				if err := fault.Wait(context.Background(), hits+1); err != nil {
					return err
				}
				time.Sleep(50 * time.Millisecond)
				return nil
			})
			require.Error(t, err)
			assert.ErrorIs(t, err, sarama.ErrOffsetOutOfRange)
		}()
	}
}

// A broker address that can never be dialled (no port) is refused at once,
// naming it, instead of every read retrying it as a broker down.
func TestNewKafkaRefusesBrokerAddressesWithoutPort(t *testing.T) {
	_, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: []string{"localhost"}, Topic: "orders.dlq"})
	require.ErrorContains(t, err, "KafkaConfig.Brokers[0]")
	_, err = dlq.NewKafka(dlq.KafkaConfig{Brokers: []string{"localhost:9092"}, Topic: "orders.dlq"})
	require.NoError(t, err)
}

type staticToken string

func (s staticToken) Token() (*sarama.AccessToken, error) {
	return &sarama.AccessToken{Token: string(s)}, nil
}

// A broker that refuses the SASL settings (a mechanism it does not offer):
// sarama reports "run out of available brokers" and drops the broker's
// answer. The reader's error names the broker and what it refused.
func TestKafkaReadSaysWhatTheBrokerRefused(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders.dlq"),
		kfake.EnableSASL(), kfake.Superuser("PLAIN", "svc", "s3cret-pw"))
	require.NoError(t, err)
	t.Cleanup(kf.Close)
	sc := testenv.Sarama()
	sc.Metadata.Retry.Max = 0
	sc.Net.SASL.Enable = true
	sc.Net.SASL.Mechanism = sarama.SASLTypeOAuth
	sc.Net.SASL.TokenProvider = staticToken("s3cret-token")
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: kf.ListenAddrs(), Topic: "orders.dlq", Sarama: sc})
	require.NoError(t, err)
	err = q.Browse(context.Background(), func(*dlq.Record) error { return nil })
	require.Error(t, err)
	t.Log(err)
	assert.Contains(t, err.Error(), "refused the SASL settings")
	assert.Contains(t, err.Error(), kf.ListenAddrs()[0])
	assert.NotContains(t, err.Error(), "s3cret")
}

// A dead-letter topic written to in transactions is read as a
// read-committed consumer reads it: the records of an aborted transaction,
// never published, are no dead letters, and those of a transaction still
// open are not read yet, nor waited for.
func TestKafkaBrowseReadsCommittedRecordsOnly(t *testing.T) {
	k := testenv.NewKafka(t)
	topic := testenv.Uniq("orders.dlq")
	k.CreateTopic(topic, 1)
	ctx := t.Context()
	transaction := func(end *kgo.TransactionEndTry, values ...string) *kgo.Client {
		tp, err := kgo.NewClient(kgo.SeedBrokers(k.Addrs...), kgo.TransactionalID(testenv.Uniq("txn")),
			kgo.RecordPartitioner(kgo.ManualPartitioner()))
		require.NoError(t, err)
		t.Cleanup(tp.Close)
		require.NoError(t, tp.BeginTransaction())
		for _, v := range values {
			require.NoError(t, tp.ProduceSync(ctx, &kgo.Record{Topic: topic, Partition: 0, Value: []byte(v)}).FirstErr())
		}
		if end != nil {
			require.NoError(t, tp.EndTransaction(ctx, *end))
		}
		return tp
	}
	commit, abort := kgo.TryCommit, kgo.TryAbort
	transaction(&commit, "a")       // 0, marker 1
	transaction(&abort, "x1", "x2") // 2, 3, marker 4
	transaction(&commit, "b")       // 5, marker 6
	transaction(nil, "open")        // 7, not ended
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: topic, Sarama: testenv.Sarama(), IdleTimeout: time.Minute})
	require.NoError(t, err)
	started := time.Now()
	recs, err := dlq.Collect(ctx, q, dlq.Filter{})
	require.NoError(t, err)
	var values []string
	for _, r := range recs {
		values = append(values, string(r.Value))
	}
	assert.Equal(t, []string{"a", "b"}, values, "aborted records are not read, nor an open transaction's")
	assert.Less(t, time.Since(started), 30*time.Second, "the read waited for the open transaction (IdleTimeout)")
}
