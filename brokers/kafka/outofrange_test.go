package kafka

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/internal/testlog"
)

// With OffsetsInDatabase, a partition whose recorded position retention
// passed while no member consumed it (the records after the position
// deleted before they were handled) starts at Config.InitialOffset, as
// sarama resets it: the records in between are lost. That happened
// without a word; it is logged at level Error, as a committed offset out
// of range is without OffsetsInDatabase: the topic, the partition, the
// position recorded, the offset the claim starts at (not sarama's
// "oldest") and how many offsets it skips.
func TestOffsetsInDatabasePositionOutOfRangeIsAnError(t *testing.T) {
	c, db, topic, group := positionBeforeDeletedRecords(t)

	cfg, logs, reader := observed(t, c.dbOffsetsConfig(group, topic))
	runToEnd(t, c, db, cfg, consumerConfig("svc"), 3)
	assert.Equal(t, map[string]int{"e-0": 1, "e-1": 1, "e-4": 1}, effectCounts(t, db), "the deleted records are lost")
	require.Eventually(t, func() bool { return len(logs.Errors()) > 0 }, 10*time.Second, 10*time.Millisecond, "the loss is logged")
	errs := logs.Errors()
	require.Len(t, errs, 1, "logged once")
	assert.Contains(t, errs[0], "the position the database records for the partition is out of the partition's range")
	for _, attr := range []string{"topic=" + topic, "partition=0", "recorded=2", "start=4", "initial_offset=oldest", "skipped=2"} {
		assert.Contains(t, errs[0], " "+attr, "the log names where the claim starts and what it skips")
	}
	assert.Eventually(t, func() bool { return outOfRangeOf(t, reader)[topic+"/0"] == 2 }, 10*time.Second, 10*time.Millisecond,
		"and counted; %v", outOfRangeOf(t, reader))
}

// With OffsetsInDatabase, a partition the table has no position for (the
// option just turned on, the row not yet written) starts at the group's
// committed offset. One out of range was reset by sarama without a word:
// the database's check looks at the table's position only, and the
// committed offset's (checkStart) ran without OffsetsInDatabase only. It
// is logged at level Error and counted, as without the option.
func TestOffsetsInDatabaseCommittedOffsetOutOfRangeIsAnError(t *testing.T) {
	c, topic, group, db := committedBelowDeletedRecords(t)
	cfg, logs, reader := observed(t, c.dbOffsetsConfig(group, topic))
	runToEnd(t, c, db, cfg, consumerConfig("svc"), 1)
	assert.Equal(t, map[string]int{"e-4": 1}, effectCounts(t, db), "the deleted records are lost")
	require.Eventually(t, func() bool { return len(logs.Errors()) > 0 }, 10*time.Second, 10*time.Millisecond, "the loss is logged")
	errs := logs.Errors()
	require.Len(t, errs, 1, "logged once")
	assert.Contains(t, errs[0], "the group's committed offset is out of the partition's range")
	for _, attr := range []string{"topic=" + topic, "partition=0", "committed=2", "start=4", "skipped=2"} {
		assert.Contains(t, errs[0], " "+attr)
	}
	assert.Equal(t, map[string]int64{topic + "/0": 2}, outOfRangeOf(t, reader), "the skipped records are counted")
}

// outOfRangeOf returns the OutOfRangeMetricName counter's values by
// "topic/partition".
func outOfRangeOf(t testing.TB, reader *sdkmetric.ManualReader) map[string]int64 {
	return partitionValues(t, reader, OutOfRangeMetricName)
}

// Without OffsetsInDatabase, a partition whose committed offset retention
// passed while the group was away (the records after it deleted before
// they were handled) starts at Config.InitialOffset, as sarama resets it
// (Consumer.Group.ResetInvalidOffsets) before the claim begins: the
// records in between were lost without a word. The claim logs it at level
// Error, naming the committed offset, where it starts and how many records
// it skips. A group's first start (no committed offset) and a committed
// offset in range log nothing.
func TestCommittedOffsetOutOfRangeIsAnError(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	const gap = "committed offset is out of the partition's range"
	run := func(want ...string) *lineCounter {
		t.Helper()
		logged := &lineCounter{match: gap, at: -1}
		cfg := c.config(group, topic)
		cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(logged, slogOutput()), nil))
		src := c.open(cfg)
		for _, v := range want {
			d := receive(t, src)
			require.Equal(t, v, string(d.Message().Value))
			require.NoError(t, d.Ack(t.Context()))
		}
		require.Eventually(t, func() bool { return src.startChecks.Load() == 1 }, 10*time.Second, 10*time.Millisecond,
			"the claim's start is checked")
		require.NoError(t, src.Close())
		return logged
	}

	c.produce(msg(topic, 0, "a"), msg(topic, 0, "b"))
	logged := run("a", "b") // the group's first start: no committed offset
	assert.Equal(t, 0, logged.count(), "a group without a committed offset starts where InitialOffset says")
	require.Equal(t, map[int32]int64{0: 2}, c.committed(group, topic, 1))

	// Records 2 and 3 are deleted before the group reads them.
	c.produce(msg(topic, 0, "c"), msg(topic, 0, "d"), msg(topic, 0, "e"))
	c.deleteRecordsBefore(topic, 0, 4)

	lost := &lineCounter{match: "level=ERROR msg=\"once/kafka: the group's " + gap, at: -1}
	cfg := c.config(group, topic)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	cfg.MeterProvider = mp
	var text strings.Builder
	var mu sync.Mutex
	cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(lost, lockedWriter{&mu, &text}), nil))
	src := c.open(cfg)
	d := receive(t, src)
	require.Equal(t, "e", string(d.Message().Value), "sarama starts at the first record left")
	require.NoError(t, d.Ack(t.Context()))
	require.Eventually(t, func() bool { return lost.count() == 1 }, 10*time.Second, 10*time.Millisecond, "the loss is logged")
	mu.Lock()
	line := text.String()
	mu.Unlock()
	for _, attr := range []string{"topic=" + topic, "partition=0", "committed=2", "start=4", "skipped=2"} {
		assert.Contains(t, line, attr)
	}
	assert.Equal(t, map[string]int64{topic + "/0": 2}, outOfRangeOf(t, reader), "the skipped records are counted")
	require.NoError(t, src.Close())

	c.produce(msg(topic, 0, "f"))
	logged = run("f") // the committed offset (5) is in range
	assert.Equal(t, 0, logged.count(), "a committed offset in range is no loss")
}

// lockedWriter writes to w under mu.
type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// slogOutput is where testLogger writes: stderr under ONCE_TEST_LOG.
func slogOutput() io.Writer {
	if os.Getenv("ONCE_TEST_LOG") != "" {
		return os.Stderr
	}
	return io.Discard
}

// observed returns cfg logging its errors to logs and its metrics to
// reader.
func observed(t *testing.T, cfg Config) (Config, *testlog.ErrorLog, *sdkmetric.ManualReader) {
	t.Helper()
	logs := &testlog.ErrorLog{}
	cfg.Logger = slog.New(logs)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	cfg.MeterProvider = mp
	return cfg, logs, reader
}

// With StartNewest, sarama reset a committed offset below the partition's
// start (records deleted by retention before the group read them) to the
// partition's end: the records still in the partition, from its start on,
// were skipped too, not only the deleted ones. StartNewest says where a
// group new to a topic starts; this group read the partition. The claim
// now starts at the partition's first record left, and the records deleted
// are logged and counted as lost.
func TestStartNewestCommittedOffsetOutOfRangeReadsWhatIsLeft(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		c := newClusterOf(t, kind)
		topic, group := uniq("orders"), uniq("g")
		c.createTopic(topic, 1)
		cfg := c.config(group, topic)
		cfg.InitialOffset = StartNewest

		src := c.open(cfg)
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		got := receiveAside(ctx, src) // joins the group, whose start is committed
		require.Eventually(t, func() bool { return committedOffset(c, group, topic, 0) >= 0 }, 20*time.Second, 20*time.Millisecond)
		c.produce(msg(topic, 0, "a"))
		r := <-got
		require.NoError(t, r.err)
		d := r.d
		require.Equal(t, "a", string(d.Message().Value))
		require.NoError(t, d.Ack(t.Context()))
		require.NoError(t, src.Close())
		require.Equal(t, map[int32]int64{0: 1}, c.committed(group, topic, 1))

		// Records 1 and 2 are deleted before the group reads them; 3 is left.
		c.produce(msg(topic, 0, "b"), msg(topic, 0, "c"), msg(topic, 0, "d"))
		c.deleteRecordsBefore(topic, 0, 3)

		cfg, logs, reader := observed(t, cfg)
		src = c.open(cfg)
		d = receive(t, src)
		require.Equal(t, "d", string(d.Message().Value), "the record left in the partition is read")
		require.NoError(t, d.Ack(t.Context()))
		require.Eventually(t, func() bool { return len(logs.Errors()) > 0 }, 10*time.Second, 10*time.Millisecond, "the loss is logged")
		errs := logs.Errors()
		require.Len(t, errs, 1, "logged once")
		for _, attr := range []string{"topic=" + topic, "partition=0", "committed=1", "start=3", "skipped=2"} {
			assert.Contains(t, errs[0], " "+attr)
		}
		assert.Equal(t, map[string]int64{topic + "/0": 2}, outOfRangeOf(t, reader), "the deleted records are counted")
		require.NoError(t, src.Close())
		require.Equal(t, map[int32]int64{0: 4}, c.committed(group, topic, 1))
	})
}

// Retention deletes records ahead of a consumer that lags behind while it
// runs: sarama's next fetch of the partition is out of range and shuts the
// partition's consumer down, the claim ends, and the next session starts
// the partition where sarama resets the committed offset. With StartOldest
// that is the first record left; with StartNewest it was the partition's
// end, skipping the records left as well.
func TestRetentionOvertakingARunningConsumer(t *testing.T) {
	for _, start := range []StartOffset{StartOldest, StartNewest} {
		t.Run(map[StartOffset]string{StartOldest: "oldest", StartNewest: "newest"}[start], func(t *testing.T) {
			eachBroker(t, func(t *testing.T, kind brokerKind) {
				c := newClusterOf(t, kind)
				topic, group := uniq("orders"), uniq("g")
				c.createTopic(topic, 1)
				cfg := c.config(group, topic)
				cfg.InitialOffset = start
				cfg.Sarama.ChannelBufferSize = 4
				cfg.FetchDefault = 1 // one batch a fetch
				src := c.open(cfg)
				ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
				defer cancel()
				got := receiveAside(ctx, src)
				require.Eventually(t, func() bool { return committedOffset(c, group, topic, 0) >= 0 || start == StartOldest },
					20*time.Second, 20*time.Millisecond)
				p := c.producer()
				for i := range 100 { // a batch each
					_, _, err := p.SendMessage(msg(topic, 0, fmt.Sprintf("r%d", i)))
					require.NoError(t, err)
				}
				r := <-got
				require.NoError(t, r.err)
				require.Equal(t, "r0", string(r.d.Message().Value))
				require.NoError(t, r.d.Ack(t.Context()))

				c.deleteRecordsBefore(topic, 0, 80)

				// What was read ahead before the deletion is handed out; then
				// the records left, 80 to 99, whatever InitialOffset says.
				var offsets []int64
				for len(offsets) == 0 || offsets[len(offsets)-1] < 99 {
					rctx, rcancel := context.WithTimeout(t.Context(), 20*time.Second)
					d, err := src.Receive(rctx)
					rcancel()
					require.NoError(t, err, "after offsets %v", offsets)
					offsets = append(offsets, d.(*delivery).Message().Offset)
					require.NoError(t, d.Ack(t.Context()))
				}
				require.NoError(t, src.Close())
				// Records 1 to 4 come first when the claim read them ahead
				// before the deletion; either way its next fetch was out of
				// range while it ran.
				t.Logf("offsets read: %v", offsets)
				assert.Subset(t, offsets, []int64{80, 81, 98, 99}, "the records left are read: %v", offsets)
			})
		})
	}
}

// With OffsetsInDatabase and StartNewest, a recorded position below the
// partition's first record (records deleted by retention before any member
// read them) made sarama start the claim at the partition's end, skipping
// the records left with the deleted ones.
func TestOffsetsInDatabaseStartNewestPositionOutOfRangeReadsWhatIsLeft(t *testing.T) {
	c, db, topic, group := positionBeforeDeletedRecords(t)

	cfg, logs, _ := observed(t, c.dbOffsetsConfig(group, topic))
	cfg.InitialOffset = StartNewest
	runToEnd(t, c, db, cfg, consumerConfig("svc"), 3)
	assert.Equal(t, map[string]int{"e-0": 1, "e-1": 1, "e-4": 1}, effectCounts(t, db), "the record left is read, the deleted ones lost")
	require.Eventually(t, func() bool { return len(logs.Errors()) > 0 }, 10*time.Second, 10*time.Millisecond, "the loss is logged")
	errs := logs.Errors()
	require.Len(t, errs, 1, "logged once")
	for _, attr := range []string{"recorded=2", "start=4", "skipped=2"} {
		assert.Contains(t, errs[0], " "+attr)
	}
	assert.Equal(t, map[int32]int64{0: 5}, offsetsRows(t, db, topic))
}

// positionBeforeDeletedRecords has a consumer with OffsetsInDatabase handle
// records 0 and 1 of a new topic (the table records position 2), then
// produces records 2 to 4 and deletes 2 and 3 before any member reads them.
func positionBeforeDeletedRecords(t *testing.T) (*cluster, *pgxpool.Pool, string, string) {
	t.Helper()
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	c.produceHashed(events(topic, "e", 0, 2))
	runToEnd(t, c, db, c.dbOffsetsConfig(group, topic), consumerConfig("svc"), 2)
	require.Equal(t, map[int32]int64{0: 2}, offsetsRows(t, db, topic))
	c.produceHashed(events(topic, "e", 2, 3))
	c.deleteRecordsBefore(topic, 0, 4)
	return c, db, topic, group
}

// With OffsetsInDatabase and StartNewest, a partition the table has no
// position for (the option just turned on) starts at the group's committed
// offset; one below the partition's first record (records deleted by
// retention before the group read them) made sarama start the claim at the
// partition's end, and the records left were skipped with the deleted
// ones, as they no longer are without OffsetsInDatabase nor for a position
// the table records.
func TestOffsetsInDatabaseStartNewestCommittedOffsetOutOfRangeReadsWhatIsLeft(t *testing.T) {
	c, topic, group, db := committedBelowDeletedRecords(t)
	cfg, logs, reader := observed(t, c.dbOffsetsConfig(group, topic))
	cfg.InitialOffset = StartNewest
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	r := startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
	defer func() { require.NoError(t, r.stop()) }()
	// The loss is logged once the claim's start is chosen; a record
	// produced then is read whatever the start.
	require.Eventually(t, func() bool { return len(logs.Errors()) > 0 }, 20*time.Second, 10*time.Millisecond, "the loss is logged")
	c.produceHashed(events(topic, "e", 5, 1))
	require.Eventually(t, func() bool { return effectCounts(t, db)["e-5"] == 1 }, 20*time.Second, 10*time.Millisecond)
	assert.Equal(t, map[string]int{"e-4": 1, "e-5": 1}, effectCounts(t, db), "the record left in the partition is read")
	errs := logs.Errors()
	require.Len(t, errs, 1, "logged once")
	for _, attr := range []string{"topic=" + topic, "partition=0", "committed=2", "start=4", "skipped=2"} {
		assert.Contains(t, errs[0], " "+attr)
	}
	assert.Equal(t, map[string]int64{topic + "/0": 2}, outOfRangeOf(t, reader), "the deleted records are counted")
}

// committedBelowDeletedRecords returns a cluster whose topic's partition 0
// holds records e-0 to e-4, of which group acked e-0 and e-1 with offsets
// in Kafka alone (committed offset 2) before e-2 and e-3 were deleted
// (e-4 is left), and a database with the effects table.
func committedBelowDeletedRecords(t *testing.T) (c *cluster, topic, group string, db *pgxpool.Pool) {
	t.Helper()
	c = newCluster(t)
	topic, group = uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	c.produceHashed(events(topic, "e", 0, 2))
	src := c.open(c.config(group, topic)) // offsets in Kafka only
	for range 2 {
		require.NoError(t, receive(t, src).Ack(t.Context()))
	}
	require.NoError(t, src.Close())
	require.Equal(t, map[int32]int64{0: 2}, c.committed(group, topic, 1))
	c.produceHashed(events(topic, "e", 2, 3))
	c.deleteRecordsBefore(topic, 0, 4)
	db, _ = pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	return c, topic, group, db
}

// With OffsetsInDatabase, a recorded position below the partition's first
// record is a loss, logged at Error and counted once. The claim started
// past it, but the table kept the old position until a record of the
// partition was handled: a partition that got none found the same loss at
// every later take-over (each restart, each rebalance), logged it again and
// counted it again, so that out_of_range.skipped, whose every increase
// says records were never handled, grew by the same records each time.
// The position the claim starts at is recorded in the table first.
func TestOffsetsInDatabasePositionOutOfRangeIsCountedOnce(t *testing.T) {
	for name, initial := range map[string]StartOffset{"newest": StartNewest, "oldest": StartOldest} {
		t.Run(name, func(t *testing.T) {
			c, db, topic, group := positionBeforeDeletedRecords(t)
			c.deleteRecordsBefore(topic, 0, 5) // no record left: the partition idles
			cfg, logs, reader := observed(t, c.dbOffsetsConfig(group, topic))
			cfg.InitialOffset = initial

			src, err := Open(t.Context(), cfg)
			require.NoError(t, err)
			r := startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
			require.Eventually(t, func() bool { return len(logs.Errors()) > 0 }, 30*time.Second, 10*time.Millisecond, "the loss is logged")
			require.NoError(t, r.stop())
			assert.Equal(t, map[int32]int64{0: 5}, offsetsRows(t, db, topic), "the table records where the claim started")

			// Restarted, the consumer handles a new record: its take-over
			// and claim are behind it.
			c.produceHashed(events(topic, "e", 5, 1))
			src, err = Open(t.Context(), cfg)
			require.NoError(t, err)
			r = startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
			require.Eventually(t, func() bool { return effectCounts(t, db)["e-5"] == 1 }, 30*time.Second, 10*time.Millisecond)
			require.NoError(t, r.stop())
			assert.Len(t, logs.Errors(), 1, "the loss logged once")
			assert.Equal(t, map[string]int64{topic + "/0": 3}, outOfRangeOf(t, reader), "the records lost counted once")
		})
	}
}

// Without OffsetsInDatabase, a committed offset below the partition's
// first record is a loss, logged at Error and counted once. Under
// StartOldest the claim started past it, but the group's committed offset
// stayed where it was until a record of the partition was acked (an ack
// marks forward from the committed offset, and nothing else marked): a
// partition that got none found the same loss at every later session
// (each restart, each rebalance), logged it again and counted the same
// records again, so that out_of_range.skipped, whose every increase says
// records were never handled, grew by the same records each time. The
// claim's start is committed when the loss is found. Under StartNewest the
// claim commits the partition's first record itself (rewindNewestStart).
func TestCommittedOffsetOutOfRangeIsCountedOnce(t *testing.T) {
	for name, initial := range map[string]StartOffset{"newest": StartNewest, "oldest": StartOldest} {
		t.Run(name, func(t *testing.T) {
			c := newCluster(t)
			topic, group := uniq("orders"), uniq("g")
			c.createTopic(topic, 1)
			c.produce(msg(topic, 0, "a"), msg(topic, 0, "b"))
			src := c.open(c.config(group, topic))
			for range 2 {
				require.NoError(t, receive(t, src).Ack(t.Context()))
			}
			require.NoError(t, src.Close())
			require.Equal(t, map[int32]int64{0: 2}, c.committed(group, topic, 1))
			// Records 2 to 4 are deleted before the group reads them; none
			// is left, and the partition idles.
			c.produce(msg(topic, 0, "c"), msg(topic, 0, "d"), msg(topic, 0, "e"))
			c.deleteRecordsBefore(topic, 0, 5)

			cfg, logs, reader := observed(t, c.config(group, topic))
			cfg.InitialOffset = initial
			src = c.open(cfg)
			ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
			defer cancel()
			_ = receiveAside(ctx, src) // joins the group; no record comes
			require.Eventually(t, func() bool { return len(logs.Errors()) > 0 && src.startChecks.Load() >= 1 },
				30*time.Second, 10*time.Millisecond, "the loss is logged")
			require.NoError(t, src.Close())
			assert.Equal(t, map[int32]int64{0: 5}, c.committed(group, topic, 1), "the group's offset is where the claim started")

			// Restarted, the member handles a new record: its session's
			// start is behind it.
			c.produce(msg(topic, 0, "f"))
			src = c.open(cfg)
			d := receive(t, src)
			require.Equal(t, "f", string(d.Message().Value))
			require.NoError(t, d.Ack(t.Context()))
			require.Eventually(t, func() bool { return src.startChecks.Load() >= 1 }, 30*time.Second, 10*time.Millisecond,
				"the claim's start is checked")
			require.NoError(t, src.Close())
			assert.Len(t, logs.Errors(), 1, "the loss logged once: %v", logs.Errors())
			assert.Equal(t, map[string]int64{topic + "/0": 3}, outOfRangeOf(t, reader), "the records lost counted once")
		})
	}
}

// Without OffsetsInDatabase, a committed offset past the partition's end
// (the log truncated under it, the topic created again while the group was
// away) makes sarama start the claim at Config.InitialOffset, logged at
// Warn as skipping nothing. But an ack marks forward only, from the
// committed offset: the acks of the records below it marked nothing, the
// group's offset stayed past the end, and every restart started at
// InitialOffset again. Under StartNewest that is the partition's end: the
// records produced while the member was stopped were never read. Under
// StartOldest each restart read the partition again from its first
// record. The claim's start is committed when the committed offset is
// found past the end.
func TestCommittedOffsetPastTheEndIsMovedBack(t *testing.T) {
	for name, initial := range map[string]StartOffset{"newest": StartNewest, "oldest": StartOldest} {
		t.Run(name, func(t *testing.T) {
			c := newCluster(t)
			topic, group := uniq("orders"), uniq("g")
			c.createTopic(topic, 1)
			c.produce(msg(topic, 0, "a"), msg(topic, 0, "b"))
			src := c.open(c.config(group, topic))
			require.NoError(t, receive(t, src).Ack(t.Context()))
			require.NoError(t, src.Close())
			commitOffset(t, c, group, topic, 0, 100) // then the log truncated below it

			cfg, _, _ := observed(t, c.config(group, topic))
			cfg.InitialOffset = initial
			src = c.open(cfg)
			if initial == StartNewest {
				ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
				defer cancel()
				got := receiveAside(ctx, src) // joins the group, its claim starting at the end
				require.Eventually(t, func() bool { return src.startChecks.Load() >= 1 }, 30*time.Second, 10*time.Millisecond,
					"the claim's start is checked")
				c.produce(msg(topic, 0, "x"))
				r := <-got
				require.NoError(t, r.err)
				require.Equal(t, "x", string(r.d.Message().Value))
				require.NoError(t, r.d.Ack(t.Context()))
			} else {
				for _, v := range []string{"a", "b"} {
					d := receive(t, src)
					require.Equal(t, v, string(d.Message().Value))
					require.NoError(t, d.Ack(t.Context()))
				}
			}
			require.Eventually(t, func() bool { return src.startChecks.Load() >= 1 }, 30*time.Second, 10*time.Millisecond)
			require.NoError(t, src.Close())
			next := int64(3) // x is offset 2
			if initial == StartOldest {
				next = 2
			}
			assert.Equal(t, map[int32]int64{0: next}, c.committed(group, topic, 1), "the acks are committed")

			// A record produced while the member is stopped is the next
			// one read after its restart.
			c.produce(msg(topic, 0, "y"))
			src = c.open(cfg)
			d := receive(t, src)
			assert.Equal(t, "y", string(d.Message().Value))
			require.NoError(t, src.Close())
		})
	}
}

// commitOffset commits offset as group's offset of topic's partition, as
// a tool resetting a group's offsets does; the group must have committed
// an offset before (kfake knows no group otherwise).
func commitOffset(t testing.TB, c *cluster, group, topic string, partition int32, offset int64) {
	t.Helper()
	client, err := sarama.NewClient(c.addrs, saramaConfig())
	require.NoError(t, err)
	defer client.Close()
	om, err := sarama.NewOffsetManagerFromClient(group, client)
	require.NoError(t, err)
	pom, err := om.ManagePartition(topic, partition)
	require.NoError(t, err)
	pom.ResetOffset(offset, "")
	pom.MarkOffset(offset, "")
	om.Commit()
	require.NoError(t, pom.Close())
	require.NoError(t, om.Close())
	require.Equal(t, offset, committedOffset(c, group, topic, partition))
}
