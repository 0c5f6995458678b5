package kafkaout

import (
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/onceco/once/outbox"
)

// A batch the broker refuses as too large while another topic's records
// fail for a passing reason in the same call: the records of the refused
// batch were not refused alone, so none of them is parked.
func TestBatchRefusedBesideAPassingFailureIsNotParked(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "small", "other"))
	require.NoError(t, err)
	defer kf.Close()
	var mixed bool
	kf.ControlKey(int16(kmsg.Produce), func(r kmsg.Request) (kmsg.Response, error, bool) {
		req := r.(*kmsg.ProduceRequest)
		if len(req.Topics) < 2 {
			kf.KeepControl()
			return nil, nil, false
		}
		mixed = true
		resp := req.ResponseKind().(*kmsg.ProduceResponse)
		for _, rt := range req.Topics {
			st := kmsg.NewProduceResponseTopic()
			st.Topic = rt.Topic
			for _, rp := range rt.Partitions {
				sp := kmsg.NewProduceResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = int16(sarama.ErrMessageSizeTooLarge)
				if rt.Topic == "other" {
					sp.ErrorCode = int16(sarama.ErrNotController)
				}
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})

	p, err := New(Config{Brokers: kf.ListenAddrs()})
	require.NoError(t, err)
	defer p.Close()
	// The four records in one request: flush triggers on the publisher's
	// own configuration (New clears a base's, which would hold a batch
	// smaller than them), set here to make the mixed request this test
	// is about.
	p.sc.Producer.Flush.Messages = 4
	p.sc.Producer.Flush.Frequency = time.Second
	var recs []outbox.Record
	for i := range 4 {
		topic := "small"
		if i == 3 {
			topic = "other"
		}
		recs = append(recs, outbox.Record{Seq: int64(i), EventID: fmt.Sprintf("e-%d", i), Topic: topic, Key: []byte("k"), Body: []byte("x")})
	}
	errs := p.Publish(t.Context(), recs)
	require.True(t, mixed, "the records went in one request")
	require.Len(t, errs, len(recs))
	for i, err := range errs {
		assert.False(t, outbox.IsRejected(err), "record %d: %v", i, err)
	}
}
