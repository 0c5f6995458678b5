package kafka

import (
	"github.com/IBM/sarama"

	"github.com/onceco/once/internal/kafkaend"
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
	return lastStableOffset(s.dlqClient, topic, partition)
}

// lastStableOffset asks client for the partition's last stable offset
// (kafkaend.LastStableOffset), and once more after refreshing the topic's
// metadata if that fails, as Client.GetOffset does.
func lastStableOffset(client sarama.Client, topic string, partition int32) (int64, error) {
	end, err := kafkaend.LastStableOffset(client, topic, partition)
	if err != nil {
		if err := client.RefreshMetadata(topic); err != nil {
			return -1, err
		}
		return kafkaend.LastStableOffset(client, topic, partition)
	}
	return end, nil
}

// lastStableClient is the consumer group's client with StartNewest,
// reading committed records. sarama starts a partition without a
// committed offset at Consumer.Offsets.Initial, sarama.OffsetNewest, which
// it resolves with GetOffset: the high-water mark, past the records of a
// transaction still open, which a read-committed consumer would then skip
// once it commits. Setup marks such a partition's start at its last
// stable offset (markStarts), but sarama resolves the start itself where
// that marking failed, for a partition that a cooperative rebalance adds
// (no Setup), and for a committed offset out of range
// (Consumer.Group.ResetInvalidOffsets). GetOffset answers the last stable
// offset for sarama.OffsetNewest, so that each of these starts where a
// read-committed Java consumer's "latest" does. sarama asks GetOffset
// nothing else of OffsetNewest than a partition consumer's start and the
// upper bound of the offsets it accepts: a committed offset past the last
// stable offset (not one this Source marked: it marks only records it
// read, below it) is then out of range and starts at the last stable
// offset, reading the open transaction's records once it commits.
type lastStableClient struct{ sarama.Client }

func (c lastStableClient) GetOffset(topic string, partition int32, time int64) (int64, error) {
	if time != sarama.OffsetNewest {
		return c.Client.GetOffset(topic, partition, time)
	}
	return lastStableOffset(c.Client, topic, partition)
}
