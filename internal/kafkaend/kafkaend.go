// Package kafkaend asks a Kafka partition where a read-committed consumer
// reads up to: its last stable offset (sarama's Client.GetOffset asks
// without the isolation level, and the broker then answers the high-water
// mark, past the records of transactions still open and the marker that
// ends the last one); and where such a consumer is handed its next record,
// past transaction markers and aborted records (FirstReadable). The
// library's source and the once CLI share it.
package kafkaend

import (
	"errors"

	"github.com/IBM/sarama"
)

// LastStableOffset asks the partition's leader for its last stable offset
// (ListOffsets, latest, read committed; version 2 or later, which every
// sarama.Version the library accepts uses). On a failed request it closes
// the connection to the leader, as sarama does, so that the next question
// opens it again.
func LastStableOffset(client sarama.Client, topic string, partition int32) (int64, error) {
	leader, err := client.Leader(topic, partition)
	if err != nil {
		return -1, err
	}
	req := sarama.NewOffsetRequest(client.Config().Version)
	req.IsolationLevel = sarama.ReadCommitted
	req.AddBlock(topic, partition, sarama.OffsetNewest, 1)
	resp, err := leader.GetAvailableOffsets(req)
	if err != nil {
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
