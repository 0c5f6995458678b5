package dlq_test

import (
	"context"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
)

// A Kafka replay held every record it selected, payload included (and
// the fetched batches they are slices of), until it ended: Collect read
// the whole selection first, and the Report kept each record whole, so
// replaying a dead-letter topic of gigabytes took as much memory. It
// reads the selection's summaries, then each record again as it
// publishes it; the Report keeps summaries. Measured at the last record
// of a dry run over 48 MiB of payloads, the heap has grown by far less
// than half of them (the in-process broker's copy is in the baseline);
// a replay's Report keeps no payload.
func TestKafkaReplayDoesNotHoldEverySelectedRecord(t *testing.T) {
	k := testenv.NewKafka(t)
	orig := testenv.Uniq("orders")
	k.CreateTopic(orig, 1)
	k.CreateTopic(orig+".dlq", 1)
	const n, size = 96, 512 << 10
	for i := range n {
		k.Produce(&sarama.ProducerMessage{Topic: orig + ".dlq", Value: sarama.ByteEncoder(make([]byte, size)), Headers: []sarama.RecordHeader{
			{Key: []byte(consumer.HeaderEventID), Value: []byte("e-" + strconv.Itoa(i))},
			{Key: []byte(consumer.HeaderConsumer), Value: []byte("billing")},
			{Key: []byte(consumer.HeaderErrorKind), Value: []byte("handler")},
			{Key: []byte(consumer.HeaderOriginalTopic), Value: []byte(orig)},
		}})
	}
	q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: k.Addrs, Topic: orig + ".dlq"})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	for _, dry := range []bool{true, false} {
		base := heapAfterGC()
		var grown uint64
		rep, err := q.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{DryRun: dry, Progress: func(done, total int, _ dlq.Outcome) {
			if done == total {
				grown = heapAfterGC() - min(base, heapAfterGC())
			}
		}})
		require.NoError(t, err, "dry run %v", dry)
		require.Equal(t, n, rep.Selected)
		require.Len(t, rep.Outcomes, n)
		if !dry {
			assert.Equal(t, n, rep.Replayed)
		}
		// A replay adds the broker's copies of the redrives (n*size) to
		// the heap.
		bound := uint64(n * size / 2)
		if !dry {
			bound = 2 * n * size
		}
		t.Logf("dry run %v: the heap grew by %d MiB (bound %d MiB)", dry, grown>>20, bound>>20)
		assert.Less(t, grown, bound, "dry run %v: the heap grew by %d MiB at the last record", dry, grown>>20)
		assert.Zero(t, len(rep.Outcomes[0].Record.Value), "dry run %v: the report keeps summaries", dry)
		assert.Equal(t, "e-0", rep.Outcomes[0].Record.EventID())
	}
}

// heapAfterGC is the bytes of the heap's live objects.
func heapAfterGC() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}
