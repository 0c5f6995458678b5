package kafka

import (
	"errors"

	"github.com/IBM/sarama"
)

// A topic deleted while its partitions are consumed, and created again
// under the same name, numbers its offsets from 0 again. sarama's
// partition consumer knows nothing of that: it reports the partition
// unknown while the topic is gone, then fetches the new topic from the
// position it had in the old one, and the new topic's records below it
// are never handled. So an unknown-partition error from the consumer
// group makes its claim ask the cluster about its topic (on a connection
// of its own, as topicIDs.lookupOnce explains; one question at a time):
// a topic that is gone, or that has another id now, ends the claim. It is
// revoked first, so that no Ack marks an offset of the old topic, which a
// commit could land on the new one, and its offset is reset to 0, the
// start of a topic created again. Its session then ends (sarama ends
// a session when one of its claims returns) and the group joins again:
// while the topic is gone Consume fails and is retried with backoff; once
// it exists again its partitions are claimed at the offsets the group has
// committed for it, none after the deletion (Kafka deletes a deleted
// topic's committed offsets), so Config.InitialOffset. With
// OffsetsInDatabase the recorded position carries the old topic's id and
// is not used for the new one.
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

// topicMaybeGone is called with each consumer group error: one that says a
// claimed partition is unknown to its broker has that claim check its
// topic (checkTopic), in the background.
func (s *Source) topicMaybeGone(err error) {
	var ce *sarama.ConsumerError
	if !errors.As(err, &ce) || !errors.Is(ce.Err, sarama.ErrUnknownTopicOrPartition) {
		return
	}
	cl := s.lag.claimOf(ce.Topic, ce.Partition)
	if cl == nil || cl.isRevoked() || !cl.topicAsked.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer cl.topicAsked.Store(false)
		cl.checkTopic()
	}()
}

// checkTopic asks the cluster whether cl's topic still exists with the id
// it had when cl was claimed, and ends cl when it does not. A question
// that fails says nothing: the next error asks again.
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
	cl.revoke()
	// Whatever the group committed for the partition was an offset of
	// the old topic; 0 is the start of any topic created under its name
	// again. (A broker that refuses the commit of a topic that is gone,
	// as Kafka does, has deleted the group's offsets of it.)
	cl.sess.ResetOffset(cl.sc.Topic(), cl.sc.Partition(), 0, "")
	s.cfg.Logger.Error("once/kafka: topic deleted (or deleted and created again) while its partition was consumed; "+
		"the claim ends, its records not yet acked are left, and the group consumes the topic from its start once it exists again",
		"group", s.cfg.Group, "stream", cl.stream, "topic_id", cl.topicID, "new_topic_id", id,
		"last_offset", cl.last.Load())
}
