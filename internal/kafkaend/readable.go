package kafkaend

import (
	"errors"

	"github.com/IBM/sarama"
)

// readableFetches bounds the fetches FirstReadable makes: each passes at
// least one batch of markers or aborted records.
const readableFetches = 8

// FirstReadable returns the offset of the partition's first record at or
// after from, below end (its last stable offset), that a read-committed
// consumer is handed: it fetches from there, read committed, a batch at a
// time, and passes transaction markers and the batches of aborted
// transactions. It returns end when there is none, and the offset reached
// when a fetch fails or after readableFetches fetches, so that the lag it
// makes is never less than the records still to be handed out. The
// source's lag gauge, once status and the dead-letter reader share it. It
// is safe for concurrent use as client is.
func FirstReadable(client sarama.Client, topic string, partition int32, from, end int64) int64 {
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
