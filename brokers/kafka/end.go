package kafka

import (
	"errors"

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

// readableFetches bounds the fetches firstReadable makes: each passes at
// least one batch of markers or aborted records.
const readableFetches = 8

// firstReadable returns the offset of the partition's first record at or
// after from, below end (its last stable offset), that a read-committed
// consumer is handed: it fetches from there, read committed, a batch at a
// time, and passes transaction markers and the batches of aborted
// transactions. It returns end when there is none, and the offset reached
// when a fetch fails or after readableFetches fetches, so that the lag it
// makes is never less than the records still to be handed out.
func firstReadable(client sarama.Client, topic string, partition int32, from, end int64) int64 {
	aborted := make(map[int64]bool)       // producer ids of aborted transactions open at from
	var txns []*sarama.AbortedTransaction // not yet begun at the batches passed
	seen := make(map[sarama.AbortedTransaction]bool)
	for range readableFetches {
		if from >= end {
			return end
		}
		leader, err := client.Leader(topic, partition)
		if err != nil {
			return from
		}
		// Version 4: the isolation level and the aborted transactions.
		// A byte of the partition: (KIP-74) its first batch, whole.
		req := &sarama.FetchRequest{Version: 4, MaxBytes: 1 << 20, Isolation: sarama.ReadCommitted}
		req.AddBlock(topic, partition, from, 1, -1)
		resp, err := leader.Fetch(req)
		if err != nil {
			_ = leader.Close()
			return from
		}
		b := resp.GetBlock(topic, partition)
		if b == nil || !errors.Is(b.Err, sarama.ErrNoError) {
			return from
		}
		for _, at := range b.AbortedTransactions {
			// Each fetch names the aborted transactions its range meets.
			if !seen[*at] {
				seen[*at] = true
				txns = append(txns, at)
			}
		}
		passed := false
		for _, records := range b.RecordsSet {
			rb := records.RecordBatch
			if rb == nil || rb.PartialTrailingRecord {
				return from // a legacy message set, or a batch not whole
			}
			after := rb.FirstOffset + int64(rb.LastOffsetDelta) + 1
			if after <= from {
				continue
			}
			// A transaction aborted is open from its first offset to
			// its marker.
			for i := 0; i < len(txns); {
				if txns[i].FirstOffset < after {
					aborted[txns[i].ProducerID] = true
					txns = append(txns[:i], txns[i+1:]...)
					continue
				}
				i++
			}
			switch {
			case rb.Control:
				delete(aborted, rb.ProducerID)
			case rb.IsTransactional && aborted[rb.ProducerID]:
			default:
				return min(max(from, rb.FirstOffset), end)
			}
			from, passed = after, true
		}
		if !passed {
			return from
		}
	}
	return min(from, end)
}
