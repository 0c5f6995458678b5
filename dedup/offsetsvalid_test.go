package dedup_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
)

// A take-over no retry can run is refused before any statement, with
// ErrInvalidOffsets, which a caller can tell from an outage, and the
// caller's transaction stays usable: a consumer name the claims refuse
// (empty, NUL, not UTF-8) made rows under it, or failed with PostgreSQL's
// 22021, and a partition named twice failed with its 21000 ("ON CONFLICT
// DO UPDATE command cannot affect row a second time"), both read as a
// database failure and aborting the caller's transaction.
func TestTakeOverRefusesInputNoStatementCanTake(t *testing.T) {
	ctx, pool, s := setup(t)
	owner := dedup.Owner{Group: "g", Generation: 1}
	one := []dedup.PartitionKey{{Topic: "t", Partition: 0}}
	bad := map[string]struct {
		consumer string
		owner    dedup.Owner
		parts    []dedup.PartitionKey
		says     string
	}{
		"empty consumer":       {"", owner, one, "consumer"},
		"NUL in the consumer":  {"bill\x00ing", owner, one, "consumer"},
		"consumer not UTF-8":   {"billing\xfe", owner, one, "consumer"},
		"a partition twice":    {"c", owner, []dedup.PartitionKey{{Topic: "t", Partition: 0}, {Topic: "u", Partition: 1}, {Topic: "t", Partition: 0}}, "t/0"},
		"twice, two topic ids": {"c", owner, []dedup.PartitionKey{{Topic: "t", Partition: 0, TopicID: "a"}, {Topic: "t", Partition: 0, TopicID: "b"}}, "t/0"},
		"topic not UTF-8":      {"c", owner, []dedup.PartitionKey{{Topic: "t\xff", Partition: 0}}, "topic"},
		"empty topic":          {"c", owner, []dedup.PartitionKey{{Topic: "", Partition: 0}}, "topic"},
		"NUL in the topic id":  {"c", owner, []dedup.PartitionKey{{Topic: "t", Partition: 0, TopicID: "a\x00"}}, "topic id"},
		"group not UTF-8":      {"c", dedup.Owner{Group: "g\xfe"}, one, "Group"},
		"key too long":         {strings.Repeat("c", 200), owner, []dedup.PartitionKey{{Topic: strings.Repeat("t", dedup.MaxKeyLength)}}, "long"},
	}
	for name, c := range bad {
		t.Run(name, func(t *testing.T) {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck
			_, err = s.TakeOverPartitions(ctx, tx, c.consumer, c.owner, c.parts)
			require.ErrorIs(t, err, dedup.ErrInvalidOffsets)
			assert.Contains(t, err.Error(), c.says)
			var one int
			require.NoError(t, tx.QueryRow(ctx, "SELECT 1").Scan(&one), "the transaction goes on")
		})
	}
}

// RecordOffsets and OffsetDone refuse a consumer name or topic the
// take-over refuses, before any statement: PostgreSQL's 22021 aborted the
// caller's transaction, and an empty name read as a fenced writer.
func TestOffsetsRefuseAConsumerPostgreSQLCannotStore(t *testing.T) {
	ctx, pool, s := setup(t)
	for name, c := range map[string]struct{ consumer, topic string }{
		"empty":           {"", "t"},
		"NUL":             {"bill\x00ing", "t"},
		"not UTF-8":       {"billing\xfe", "t"},
		"topic not UTF-8": {"billing", "t\xff"},
	} {
		t.Run(name, func(t *testing.T) {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck
			err = s.RecordOffsets(ctx, tx, c.consumer, dedup.OffsetsUpdate{Topic: c.topic, Epoch: 1, DoneBelow: -1, Done: []int64{0}})
			require.ErrorIs(t, err, dedup.ErrInvalidOffsets)
			assert.NotErrorIs(t, err, dedup.ErrFenced)
			_, err = s.OffsetDone(ctx, tx, c.consumer, dedup.PartitionKey{Topic: c.topic}, 0)
			require.ErrorIs(t, err, dedup.ErrInvalidOffsets)
			var one int
			require.NoError(t, tx.QueryRow(ctx, "SELECT 1").Scan(&one), "the transaction goes on")
		})
	}
}
