package kafka

import (
	"net"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// A topic just created reaches the brokers' metadata some time after the
// controller answered CreateTopics: on a loaded cluster a broker asked
// for it at once may still answer UNKNOWN_TOPIC_OR_PARTITION for a while.
// Open created a missing dead-letter topic and then refreshed the
// client's metadata once (sarama's Metadata.Retry: 3 tries, 250 ms apart),
// and failed with "kafka: creating dead-letter topic ...: kafka server:
// Request was for a topic or partition that does not exist" when the
// topic took longer to appear. It waits for the topic now, until ctx
// ends.
func TestOpenWaitsForTheDeadLetterTopicItCreatedToBeSeen(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	dlq := topic + ".dlq"
	c.createTopic(topic, 1)

	// After the dead-letter topic is created, the broker answers the
	// first 12 questions naming it alone as if it did not exist yet
	// (about 3 s of sarama's default retries: more than one refresh).
	var created atomic.Bool
	var unseen atomic.Int32
	unseen.Store(12)
	c.kf.ControlKey(kmsg.CreateTopics.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.kf.KeepControl()
		for _, rt := range req.(*kmsg.CreateTopicsRequest).Topics {
			if rt.Topic == dlq {
				created.Store(true)
			}
		}
		return nil, nil, false
	})
	c.kf.ControlKey(kmsg.Metadata.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.kf.KeepControl()
		mreq := req.(*kmsg.MetadataRequest)
		if !created.Load() || len(mreq.Topics) != 1 || mreq.Topics[0].Topic == nil || *mreq.Topics[0].Topic != dlq {
			return nil, nil, false
		}
		if unseen.Add(-1) < 0 {
			return nil, nil, false
		}
		return unknownTopic(t, c, mreq), nil, true
	})

	cfg := c.config(group, topic)
	cfg.DeadLetter.Create = true
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err, "Open waits for the topic it created")
	require.NoError(t, src.Close())
	require.Negative(t, unseen.Load(), "the broker did not see the topic for a while, and Open asked again")
}

// unknownTopic is kfake's one broker's answer to req as if its topics did
// not exist.
func unknownTopic(t *testing.T, c *cluster, req *kmsg.MetadataRequest) *kmsg.MetadataResponse {
	resp := req.ResponseKind().(*kmsg.MetadataResponse)
	resp.Version = req.Version
	host, port, err := net.SplitHostPort(c.addrs[0])
	require.NoError(t, err)
	p, err := strconv.Atoi(port)
	require.NoError(t, err)
	b := kmsg.NewMetadataResponseBroker()
	b.NodeID, b.Host, b.Port = 0, host, int32(p)
	resp.Brokers = append(resp.Brokers, b)
	resp.ControllerID = 0
	for _, rt := range req.Topics {
		mt := kmsg.NewMetadataResponseTopic()
		mt.Topic = rt.Topic
		mt.ErrorCode = kerr.UnknownTopicOrPartition.Code
		resp.Topics = append(resp.Topics, mt)
	}
	return resp
}
