package kafka

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// A final commit the coordinator refuses (here the member unknown to it,
// as after being fenced) commits nothing, as docs/kafka.md says ("Clean
// stop"): it is logged, Run returns as from a clean stop, and the next run
// of the group gets the records again and skips each as a duplicate, so
// that every event's effect happened once.
func TestRefusedFinalCommitDoublesNothing(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("final-commit-run"), uniq("final-commit-run-g")
	c.createTopic(topic, 1)
	const n = 10
	c.produceHashed(events(topic, "fc", 0, n))
	db := effectsDB(t)
	var refusing atomic.Bool
	refusing.Store(true)
	refusedCommits := refuseCommits(c, &refusing)

	cfg := c.config(group, topic)
	cfg.CommitInterval = time.Hour // only the final commit commits
	first := startConsumer(t, db, c.open(cfg), consumerConfig("svc"), recordEffect)
	require.Eventually(t, func() bool { return first.c.Stats().Handled == n }, 30*time.Second, 20*time.Millisecond)
	require.NoError(t, first.stop())
	require.Positive(t, refusedCommits.Load(), "the final commit was sent")
	require.Equal(t, map[int32]int64{0: -1}, c.committed(group, topic, 1), "the refused commit committed nothing")

	refusing.Store(false)
	second := startConsumer(t, db, c.open(cfg), consumerConfig("svc"), recordEffect)
	require.Eventually(t, func() bool { return second.c.Stats().Duplicates == n }, 30*time.Second, 20*time.Millisecond,
		"the records whose offsets were not committed come again and are skipped")
	require.NoError(t, second.stop())
	assert.Zero(t, second.c.Stats().Handled)
	requireExactlyOnce(t, db, "fc", n)
	assert.Equal(t, map[int32]int64{0: n}, c.committed(group, topic, 1), "the second run's final commit committed them")
}

// refuseCommits makes the cluster refuse every offset commit, as a
// coordinator that no longer knows the member does, while refusing is
// set; it returns the count of commits refused.
func refuseCommits(c *cluster, refusing *atomic.Bool) *atomic.Int32 {
	var refused atomic.Int32
	c.kf.ControlKey(kmsg.OffsetCommit.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.kf.KeepControl()
		if !refusing.Load() {
			return nil, nil, false
		}
		creq := req.(*kmsg.OffsetCommitRequest)
		resp := creq.ResponseKind().(*kmsg.OffsetCommitResponse)
		resp.Version = creq.Version
		for _, rt := range creq.Topics {
			st := kmsg.NewOffsetCommitResponseTopic()
			st.Topic = rt.Topic
			for _, rp := range rt.Partitions {
				sp := kmsg.NewOffsetCommitResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = kerr.UnknownMemberID.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		refused.Add(1)
		return resp, nil, true
	})
	return &refused
}
