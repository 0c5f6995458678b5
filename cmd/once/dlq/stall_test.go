package dlq_test

import (
	"context"
	"strconv"
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
	"github.com/onceco/once/consumer"
)

// A leader election of the dead-letter topic's partition that outlasts
// KafkaConfig.IdleTimeout (5 s; once has no flag for it) while a replay
// reads the dead letters ended that partition's read where it was, and the
// replay went on with the records read so far as if they were all: "3
// selected, replayed 3", no error, exit 0, while seven dead letters were
// never selected. An operator who ran `once dlq replay -all` is told the
// destination was redriven; its rest stays dead-lettered, unnoticed. A
// read that stops short of the records it knows are there must fail (the
// replay then publishes nothing and can be run again), not pass for whole.
func TestKafkaReplayDuringALeaderElectionDoesNotPassForWhole(t *testing.T) {
	k := testenv.NewKafka(t)
	topic := testenv.Uniq("orders")
	k.CreateTopic(topic, 1)
	k.CreateTopic(topic+".dlq", 1)
	const n = 10
	for i := range n { // a batch each
		id := "e-" + strconv.Itoa(i)
		k.Produce(&sarama.ProducerMessage{Topic: topic + ".dlq", Value: sarama.StringEncoder(`{"n":` + strconv.Itoa(i) + `}`),
			Headers: []sarama.RecordHeader{
				{Key: []byte(consumer.HeaderEventID), Value: []byte(id)},
				{Key: []byte(consumer.HeaderConsumer), Value: []byte("billing")},
				{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
				{Key: []byte(consumer.HeaderOriginalTopic), Value: []byte(topic)},
			}})
	}
	sc := testenv.Sarama()
	sc.Consumer.Fetch.Default = 1 // a batch a fetch, as with large dead letters
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: topic + ".dlq", Sarama: sc})
	require.NoError(t, err)

	// From the fourth record on, the partition has no leader for 8 s.
	election := k.Cluster.Fault(kfake.Fault{Keys: []kmsgs.Key{kmsgs.Fetch}, Topic: topic + ".dlq", Err: kerr.NotLeaderForPartition, Count: -1,
		When: func(req kmsgs.Request) bool {
			f := req.(*kmsgs.FetchRequest)
			return len(f.Topics) > 0 && len(f.Topics[0].Partitions) > 0 && f.Topics[0].Partitions[0].FetchOffset >= 3
		}})
	timer := time.AfterFunc(8*time.Second, election.Remove)
	defer timer.Stop()

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := q.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{})
	if err == nil {
		assert.Equal(t, n, rep.Selected, "the replay said it was done, having read %d of the %d dead letters", rep.Selected, n)
		assert.Equal(t, n, rep.Replayed)
	} else {
		t.Logf("the replay failed: %v", err)
		assert.Zero(t, rep.Replayed, "a replay whose read failed publishes nothing")
	}
}
