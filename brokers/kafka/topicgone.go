package kafka

import (
	"errors"
	"sync"
	"time"

	"github.com/IBM/sarama"
)

// A topic deleted while its partitions are consumed, and created again
// under the same name, numbers its offsets from 0 again. sarama's
// partition consumer knows nothing of that: it reports the partition
// unknown while the topic is gone, then fetches the new topic from the
// position it had in the old one, and the new topic's records below it
// are never handled. So an unknown-partition error from the consumer
// group makes its claim ask the cluster about its topic (on a connection
// of its own, as topicIDs.lookupOnce explains; one question at a time).
//
// A topic that is gone in two answers in a row, or that has another id
// now, ends the claim's consuming: it is revoked, so that no Ack marks an
// offset of the old topic (a commit could land it on the new one), its
// offset is reset to 0 (the start of a topic created again; a broker that
// refuses the commit of a topic that is gone, as Kafka does, has deleted
// the group's offsets of it), and the claim is logged at Error. One whose
// topic has another id returns at once: its session ends (sarama ends a
// session when one of its claims returns), and the group joins again and
// claims the new topic from its start. One whose topic is gone is held,
// its fetching paused, until the topic exists again (asked every
// goneCheckEvery) or the session ends: returning it would end the
// member's session, and the group's next join would fail for every topic
// while one of them is missing (sarama's Consume refreshes the metadata of
// all of them), stopping the topics that still exist too.
//
// A topic deleted and created again between two of the partition
// consumer's fetches, so quickly that no fetch found it missing, is not
// seen by this; a deletion takes Kafka long enough that it is not seen
// in practice.

// topicMissingAnswers is how many answers in a row must say a claim's
// topic is unknown before the claim takes it for deleted: one broker's
// answer could come from metadata it has not caught up on, and the claim's
// offset is reset to the topic's start.
const topicMissingAnswers = 2

// goneCheckEvery is how often a claim held for a deleted topic asks
// whether the topic exists again.
const goneCheckEvery = time.Second

// What a claim found of its topic (claim.topicGone).
const (
	topicThere int32 = iota
	topicDeleted
	topicRecreated
)

// topicError reports whether err, a consumer group error, is about a
// claimed partition whose topic the claim already found gone: such errors
// repeat at each of sarama's retries and are not logged again. Any other
// unknown-partition error has its claim check its topic (checkTopic), in
// the background.
func (s *Source) topicError(err error) (known bool) {
	var ce *sarama.ConsumerError
	if !errors.As(err, &ce) || !errors.Is(ce.Err, sarama.ErrUnknownTopicOrPartition) {
		return false
	}
	cl := s.lag.claimOf(ce.Topic, ce.Partition)
	if cl == nil {
		return false
	}
	if cl.topicGone.Load() != topicThere {
		return true
	}
	if cl.isRevoked() || !cl.topicAsked.CompareAndSwap(false, true) {
		return false
	}
	go func() {
		defer cl.topicAsked.Store(false)
		cl.checkTopic()
	}()
	return false
}

// checkTopic asks the cluster whether cl's topic still exists with the id
// it had when cl was claimed, and ends cl's consuming when it does not. A
// question that fails says nothing: the next error asks again.
func (cl *claim) checkTopic() {
	s := cl.src
	id, err := s.topicIDs.lookupOnce(cl.sc.Topic())
	deleted := errors.Is(err, sarama.ErrUnknownTopicOrPartition)
	recreated := err == nil && id != "" && cl.topicID != "" && id != cl.topicID
	switch {
	case err != nil && !deleted:
		return
	case deleted && cl.topicMissing.Add(1) < topicMissingAnswers:
		return
	case !deleted && !recreated:
		cl.topicMissing.Store(0)
		return
	}
	state := topicRecreated
	if deleted {
		state = topicDeleted
	}
	cl.topicGone.Store(state)
	cl.revoke()
	cl.sess.ResetOffset(cl.sc.Topic(), cl.sc.Partition(), 0, "")
	s.cfg.Logger.Error("once/kafka: topic deleted (or deleted and created again) while its partition was consumed; "+
		"the claim's records not yet acked are left, and the group consumes the topic from its start once it exists again",
		"group", s.cfg.Group, "stream", cl.stream, "topic_id", cl.topicID, "new_topic_id", id,
		"last_offset", cl.last.Load())
}

// holdGone keeps the claim of a partition whose topic was deleted, its
// fetching paused, until the topic exists again, the session ends, the
// partition is revoked (Messages() closed) or the Source is closing. The
// claim then returns, which ends the member's session: the group joins
// again and claims the topic afresh.
func (s *Source) holdGone(sess sarama.ConsumerGroupSession, sc sarama.ConsumerGroupClaim) {
	part := map[string][]int32{sc.Topic(): {sc.Partition()}}
	s.group.Pause(part)
	defer s.group.Resume(part)
	tick := time.NewTicker(goneCheckEvery)
	defer tick.Stop()
	for {
		select {
		case _, ok := <-sc.Messages():
			if !ok {
				return
			}
		case <-tick.C:
			if _, err := s.topicIDs.lookupOnce(sc.Topic()); err == nil {
				// Committed now, whatever sarama's commit of it while the
				// topic was gone met: the group claims the new topic at
				// its start, also with StartNewest, whose start would be
				// the end of the records produced to it meanwhile.
				sess.ResetOffset(sc.Topic(), sc.Partition(), 0, "")
				sess.Commit()
				s.cfg.Logger.Info("once/kafka: deleted topic exists again; claiming it afresh from its start",
					"group", s.cfg.Group, "topic", sc.Topic(), "partition", sc.Partition())
				return
			}
		case <-sess.Context().Done():
			return
		case <-s.closing:
			return
		}
	}
}

// heldGoneClient is the consumer group's client. The group's leader asks
// it, every Metadata.RefreshFrequency (sarama's check of its topics'
// partition counts), for the partitions of every topic the group reads,
// and makes the group join again when one cannot be answered: for a topic
// deleted while consumed that join would fail for every topic while the
// topic is missing, stopping the topics that still exist too, which
// holding the deleted topic's claim (holdGone) is there to avoid. So a
// topic the cluster no longer knows is answered with its partitions as
// last known. The leader need not be the member that holds the deleted
// topic's claim: that claim ends the session once the topic exists again,
// and a topic that has partitions again is answered as it is (a topic
// given more partitions still makes the group join again). A join asks the
// cluster itself (sarama's Consume refreshes the metadata of every topic
// first), so a topic missing at a join is not hidden.
type heldGoneClient struct {
	sarama.Client

	mu    sync.Mutex
	known map[string][]int32 // the last answer of each topic
}

// Partitions returns the partitions of topic, as last known when the
// cluster no longer knows topic.
func (c *heldGoneClient) Partitions(topic string) ([]int32, error) {
	ps, err := c.Client.Partitions(topic)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err == nil {
		c.known[topic] = ps
		return ps, nil
	}
	if last, ok := c.known[topic]; ok && errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
		return last, nil
	}
	return ps, err
}
