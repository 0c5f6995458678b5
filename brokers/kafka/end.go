package kafka

import (
	"errors"

	"github.com/IBM/sarama"
)

// partitionEnd returns the offset a consumer of the partition at the
// Source's isolation level reads up to: reading committed records (the
// default), the partition's last stable offset, before the first record
// of a transaction still open; with Config.ReadUncommitted, its
// high-water mark. sarama's Client.GetOffset asks without the isolation
// level, so the broker answers the high-water mark, past the records of
// open transactions (and the marker that ends the last one). Like
// GetOffset, it asks the partition's leader, and once more after
// refreshing the topic's metadata if that fails.
func (s *Source) partitionEnd(topic string, partition int32) (int64, error) {
	if s.cfg.ReadUncommitted {
		return s.dlqClient.GetOffset(topic, partition, sarama.OffsetNewest)
	}
	end, err := lastStableOffset(s.dlqClient, topic, partition)
	if err != nil {
		if err := s.dlqClient.RefreshMetadata(topic); err != nil {
			return -1, err
		}
		return lastStableOffset(s.dlqClient, topic, partition)
	}
	return end, nil
}

// lastStableOffset asks the partition's leader for its last stable offset
// (ListOffsets, latest, read committed; version 2 or later, which every
// Sarama.Version the Source accepts uses).
func lastStableOffset(client sarama.Client, topic string, partition int32) (int64, error) {
	leader, err := client.Leader(topic, partition)
	if err != nil {
		return -1, err
	}
	req := sarama.NewOffsetRequest(client.Config().Version)
	req.IsolationLevel = sarama.ReadCommitted
	req.AddBlock(topic, partition, sarama.OffsetNewest, 1)
	resp, err := leader.GetAvailableOffsets(req)
	if err != nil {
		// As sarama does: the next question opens the connection again.
		_ = leader.Close()
		return -1, err
	}
	b := resp.GetBlock(topic, partition)
	if b == nil {
		_ = leader.Close()
		return -1, sarama.ErrIncompleteResponse
	}
	if !errors.Is(b.Err, sarama.ErrNoError) {
		return -1, b.Err
	}
	if len(b.Offsets) != 1 {
		return -1, sarama.ErrOffsetOutOfRange
	}
	return b.Offsets[0], nil
}
