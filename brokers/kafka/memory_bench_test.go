package kafka

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
)

// BenchmarkStuckKeyMemory shows what a partition holds when one key is
// stuck and a backlog piles up behind it, with key lanes: a million
// records (ONCE_STUCK_RECORDS overrides) of other keys are produced behind
// one record that is never acked, into Apache Kafka (a JVM of its own, so
// that the broker's memory is not this process's). The Go heap in use and
// the process's RSS are sampled after every tenth of the backlog. With the
// default bound they stay flat; "unbounded" (the bound set out of reach,
// as before it existed) grows with the backlog. Run it with:
//
//	go test -run '^$' -bench StuckKeyMemory -benchtime 1x ./brokers/kafka
func BenchmarkStuckKeyMemory(b *testing.B) {
	records := 1_000_000
	if v, err := strconv.Atoi(os.Getenv("ONCE_STUCK_RECORDS")); err == nil && v > 0 {
		records = v
	}
	for _, bc := range []struct {
		name  string
		bound int
	}{{"bounded", DefaultMaxPendingPerPartition}, {"unbounded", 1 << 30}} {
		b.Run(bc.name, func(b *testing.B) {
			for range b.N {
				stuckKeyMemory(b, records, bc.bound)
			}
		})
	}
}

func stuckKeyMemory(b *testing.B, records, bound int) {
	c := newClusterOf(b, apacheKafka)
	topic := uniq("stuck")
	c.createTopic(topic, 1)
	cfg := c.config(uniq("g"), topic)
	cfg.KeyLanes = 4
	cfg.MaxPendingPerPartition = bound
	s := c.open(cfg)

	// The consumer: every record is acked at once except the stuck key's.
	var received atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		for {
			d, err := s.Receive(ctx)
			if err != nil {
				return
			}
			received.Add(1)
			if string(d.Message().Key) != "stuck" {
				_ = d.Ack(ctx)
			}
		}
	}()

	produce := stuckKeyProducer(b, c, topic)
	produce("stuck", 1)
	keys := keysOffLane("stuck", cfg.KeyLanes, 64)
	step := records / 10
	produced := 1
	var heap, rss []float64
	for produced < records+1 {
		produce(keys[produced%len(keys)], step)
		produced += step
		// Wait until the consumer took what it will take: everything, or
		// up to the bound (the partition is then paused).
		require.Eventually(b, func() bool {
			return received.Load() == int64(produced) || s.claimsWaitingForRoom() == 1
		}, 5*time.Minute, 10*time.Millisecond)
		h, r := memoryNow()
		heap, rss = append(heap, h), append(rss, r)
	}
	b.Logf("bound %d, %d records behind a stuck key; received %d; pending max %d", bound, records, received.Load(), s.maxPendingSeen())
	b.Logf("heap in use MB after each tenth: %s", mbList(heap))
	b.Logf("RSS MB after each tenth:         %s", mbList(rss))
	b.ReportMetric(heap[0], "heap-MB-first-tenth")
	b.ReportMetric(heap[len(heap)-1], "heap-MB-all")
	b.ReportMetric(rss[0], "rss-MB-first-tenth")
	b.ReportMetric(rss[len(rss)-1], "rss-MB-all")
	b.ReportMetric(float64(s.maxPendingSeen()), "pending-max")
}

// stuckKeyProducer returns a function producing n records of ~100 bytes
// with key and an id header.
func stuckKeyProducer(b *testing.B, c *cluster, topic string) func(key string, n int) {
	sc := saramaConfig()
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForLocal
	p, err := sarama.NewSyncProducer(c.addrs, sc)
	require.NoError(b, err)
	b.Cleanup(func() { _ = p.Close() })
	var seq int
	value := sarama.ByteEncoder(strings.Repeat("x", 100))
	return func(key string, n int) {
		for n > 0 {
			batch := make([]*sarama.ProducerMessage, 0, min(n, 5000))
			for range min(n, 5000) {
				seq++
				batch = append(batch, &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(key), Value: value,
					Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte("ev-" + strconv.Itoa(seq))}}})
			}
			require.NoError(b, p.SendMessages(batch))
			n -= len(batch)
		}
	}
}

// memoryNow returns the Go heap in use and the process's resident set, in
// MB, after a collection that returns freed memory to the OS.
func memoryNow() (heapMB, rssMB float64) {
	debug.FreeOSMemory()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	heapMB = float64(ms.HeapInuse) / (1 << 20)
	status, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(status), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseFloat(f[1], 64)
			rssMB = kb / 1024
		}
	}
	return heapMB, rssMB
}

func mbList(v []float64) string {
	out := make([]string, len(v))
	for i, x := range v {
		out[i] = fmt.Sprintf("%.0f", x)
	}
	return strings.Join(out, " ")
}
