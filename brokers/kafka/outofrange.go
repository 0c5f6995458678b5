package kafka

import (
	"errors"
	"sync"

	"github.com/IBM/sarama"
)

// OutOfRangeMetricName is the name of the counter of offsets a claim
// skipped because the position it was to start at was out of the
// partition's range, below the partition's first offset (its records
// deleted by retention before they were handled, or the log truncated):
// the group's committed offset, or with Config.OffsetsInDatabase the
// position the database records (the group's committed offset where the
// database records none). sarama then starts the claim at
// Config.InitialOffset (Consumer.Group.ResetInvalidOffsets), and the
// records between the two are never handled; each such start is also
// logged at level Error. It counts offsets, not records (a transaction's
// marker takes one), and with StartNewest the records still in the
// partition before its end as well. A start that sarama resets is
// counted once the cluster said where it is, aside from the claim; a
// question that fails counts nothing. Its attributes are those of
// LagMetricName.
const OutOfRangeMetricName = "once.kafka.consumer.out_of_range.skipped"

// sessionCommitted is the group's committed offsets of a session's
// claims, asked of the coordinator once, by the first claim of the
// session that starts at Config.InitialOffset (checkStart).
type sessionCommitted struct {
	once    sync.Once
	offsets map[topicPartition]int64 // nil when the question failed
}

// committed returns the group's committed offset of the partition (-1
// where none), and false when it cannot be known. The session's claims
// are asked once together; a partition they did not list when asked (a
// cooperative rebalance added it since) is asked alone.
func (c *sessionCommitted) committed(s *Source, sess sarama.ConsumerGroupSession, topic string, partition int32) (int64, bool) {
	c.once.Do(func() {
		offsets, err := s.committedOffsets(sess.Claims())
		if err != nil {
			s.cfg.Logger.Warn("once/kafka: cannot read the group's committed offsets to check the start of partitions claimed at Config.InitialOffset",
				"group", s.cfg.Group, "error", err)
			return
		}
		c.offsets = offsets
	})
	if c.offsets == nil {
		return 0, false
	}
	tp := topicPartition{topic, partition}
	if o, ok := c.offsets[tp]; ok {
		return o, true
	}
	offsets, err := s.committedOffsets(map[string][]int32{topic: {partition}})
	if err != nil {
		return 0, false
	}
	o, ok := offsets[tp]
	return o, ok
}

// committedOffsets returns the group's committed offsets of partitions,
// -1 where none; a partition whose answer is an error is left out.
func (s *Source) committedOffsets(partitions map[string][]int32) (map[topicPartition]int64, error) {
	resp, err := s.fetchCommitted(partitions)
	if err != nil {
		return nil, err
	}
	out := make(map[topicPartition]int64)
	for topic, ps := range partitions {
		for _, p := range ps {
			if b := resp.GetBlock(topic, p); b != nil && errors.Is(b.Err, sarama.ErrNoError) {
				out[topicPartition{topic, p}] = b.Offset
			}
		}
	}
	return out, nil
}

// checkStart finds a claim that sarama started at Config.InitialOffset
// (initial, sarama.OffsetOldest or OffsetNewest) though the group had a
// committed offset of the partition: one out of the partition's range,
// which sarama resets (Consumer.Group.ResetInvalidOffsets) before the
// claim begins, without a word. A committed offset below the partition's
// start (its records deleted by retention before the group read them)
// means that the records between it and where the claim starts are never
// handled: it is logged at level Error, with the topic, the partition,
// the committed offset, the start and how many offsets the claim skips.
// One past the partition's end (the log truncated, the topic deleted and
// created again) skips nothing and is logged at level Warn. Either way the
// start is committed first (claim.commitStart): an ack marks forward from
// the committed offset only, so that below the start a partition that gets
// no record kept the offset, and the next session logged and counted the
// same loss again; past the end no ack was ever committed, and every
// restart started at InitialOffset again (under StartNewest past the
// records produced while the member was stopped).
//
// It runs aside, so that the claim does not wait for the cluster: the
// claim's first acks may be committed before the coordinator answers,
// but those lie between the start and the end, which is neither case.
// Only claims that start at Config.InitialOffset ask (a group's first
// start, or such a reset), once per session for all of them. With
// Config.OffsetsInDatabase the position is the database's, and
// checkRecordedStart checks it instead; a partition the table has no
// position for starts at the group's committed offset, and is checked
// here.
func (s *Source) checkStart(cl *claim, initial int64) {
	sess, topic, partition := cl.sess, cl.sc.Topic(), cl.sc.Partition()
	if initial >= 0 {
		s.startChecks.Add(1)
		return
	}
	v, _ := s.committedAtStart.LoadOrStore(sess, &sessionCommitted{})
	sc := v.(*sessionCommitted)
	go func() {
		defer s.startChecks.Add(1)
		start, err := s.resolveStart(topic, partition, initial)
		if err != nil {
			return
		}
		committed, ok := sc.committed(s, sess, topic, partition)
		if !ok || committed < 0 {
			return // the group had none: InitialOffset is where it starts
		}
		if committed < start {
			cl.commitStart(start)
			s.lag.skippedOutOfRange(topic, partition, start-committed)
			s.cfg.Logger.Error("once/kafka: the group's committed offset is out of the partition's range "+
				"(its records deleted by retention before they were handled, or the log truncated); the claim starts at Config.InitialOffset, "+
				"and the records between the two are not handled",
				"group", s.cfg.Group, "topic", topic, "partition", partition, "committed", committed,
				"start", start, "initial_offset", startName(initial), "skipped", start-committed)
			return
		}
		// Past the end: the high-water mark, which no commit of this
		// claim passes.
		end, err := s.dlqClient.GetOffset(topic, partition, sarama.OffsetNewest)
		if err == nil && committed > end {
			cl.commitStart(start)
			s.cfg.Logger.Warn("once/kafka: the group's committed offset is past the partition's end "+
				"(the log truncated, or the topic deleted and created again); the claim starts at Config.InitialOffset, committed as the group's offset",
				"group", s.cfg.Group, "topic", topic, "partition", partition, "committed", committed,
				"end", end, "start", start, "initial_offset", startName(initial))
		}
	}()
}

// resolveStart returns where sarama starts a partition at initial,
// sarama.OffsetOldest or OffsetNewest, asked the way sarama asks
// (lastStableClient for OffsetNewest, reading committed records with
// StartNewest).
func (s *Source) resolveStart(topic string, partition int32, initial int64) (int64, error) {
	if initial == sarama.OffsetNewest {
		return s.partitionEnd(topic, partition)
	}
	return s.dlqClient.GetOffset(topic, partition, sarama.OffsetOldest)
}

// checkRecordedStart logs and counts, aside, a claim that sarama started
// at Config.InitialOffset (initial) because the position the database
// records for the partition (Config.OffsetsInDatabase), recorded, was out
// of the partition's range, with the same attributes as checkStart's logs
// of a committed offset out of range (recorded in place of committed): a
// position below the partition's start is logged at level Error with the
// offset the claim starts at and how many it skips, and counted; one past
// the partition's end skips nothing and is logged at level Warn. It runs
// aside, so that the claim does not wait for the cluster; when the start
// cannot be asked (the cluster unreachable, the Source closing) the loss
// is still logged at level Error, without the start and the count. initial
// 0 or above (a position sarama did not reset, though it differs from the
// recorded one) is where the claim starts. A position below the start is
// moved there in the table (recordStart) before the loss is logged:
// kept, a partition that then gets no record would have the same records
// logged and counted lost again at every later take-over.
func (s *Source) checkRecordedStart(cl *claim, recorded, initial int64) {
	topic, partition := cl.sc.Topic(), cl.sc.Partition()
	const lost = "once/kafka: the position the database records for the partition is out of the partition's range " +
		"(its records deleted by retention before they were handled, or the log truncated); the claim starts at Config.InitialOffset, " +
		"and the records between the two are not handled"
	go func() {
		start := initial
		if initial < 0 {
			var err error
			if start, err = s.resolveStart(topic, partition, initial); err != nil {
				s.cfg.Logger.Error(lost, "group", s.cfg.Group, "topic", topic, "partition", partition, "recorded", recorded,
					"initial_offset", startName(initial), "start_error", err)
				return
			}
		}
		if recorded < start {
			s.recordStart(cl, start)
			s.lag.skippedOutOfRange(topic, partition, start-recorded)
			s.cfg.Logger.Error(lost, "group", s.cfg.Group, "topic", topic, "partition", partition, "recorded", recorded,
				"start", start, "initial_offset", startName(initial), "skipped", start-recorded)
			return
		}
		// Past the end: the high-water mark.
		end, err := s.dlqClient.GetOffset(topic, partition, sarama.OffsetNewest)
		if err == nil && recorded > end {
			s.cfg.Logger.Warn("once/kafka: the position the database records for the partition is past the partition's end "+
				"(the log truncated); the claim starts at Config.InitialOffset",
				"group", s.cfg.Group, "topic", topic, "partition", partition, "recorded", recorded,
				"end", end, "start", start, "initial_offset", startName(initial))
		}
	}()
}
