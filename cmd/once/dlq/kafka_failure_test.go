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
