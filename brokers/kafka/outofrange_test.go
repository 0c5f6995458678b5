package kafka

import (
	"context"
	"log/slog"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// With OffsetsInDatabase, a partition whose recorded position retention
// passed while no member consumed it (the records after the position
// deleted before they were handled) starts at Config.InitialOffset, as
// sarama resets it: the records in between are lost. That happened
// without a word; it is logged at level Error, naming the position
// recorded and where the claim starts.
func TestOffsetsInDatabasePositionOutOfRangeIsAnError(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	c.produceHashed(events(topic, "e", 0, 2))
	runToEnd(t, c, db, c.dbOffsetsConfig(group, topic), consumerConfig("svc"), 2)
	require.Equal(t, map[int32]int64{0: 2}, offsetsRows(t, db, topic))

	// Records 2 and 3 are deleted before any member reads them.
	c.produceHashed(events(topic, "e", 2, 3))
	admin, err := sarama.NewClusterAdmin(c.addrs, saramaConfig())
	require.NoError(t, err)
	require.NoError(t, admin.DeleteRecords(topic, map[int32]int64{0: 4}))
	require.NoError(t, admin.Close())

	logged := &lineCounter{match: "out of the partition's range", at: -1}
	cfg := c.dbOffsetsConfig(group, topic)
	cfg.Logger = slog.New(slog.NewTextHandler(logged, nil))
	runToEnd(t, c, db, cfg, consumerConfig("svc"), 3)
	assert.Equal(t, map[string]int{"e-0": 1, "e-1": 1, "e-4": 1}, effectCounts(t, db), "the deleted records are lost")
	assert.Equal(t, 1, logged.count(), "the loss is logged")
}
