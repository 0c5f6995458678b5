package kafka

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// With Config.OffsetsInDatabase, the Ack of a dead-lettered record
// records it done in the database. A stop while that statement waits (the
// offsets table locked, a database that stopped answering) ends within
// the consumer's ShutdownTimeout, not a bound of the adapter's own.
func TestDeadLetterRecordEndsAtShutdownTimeout(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	c.createTopic(topic+".dlq", 1)
	db, _ := pgtest.Schema(t)
	ctx := context.Background()
	_, err := db.Exec(ctx, effectsTable)
	require.NoError(t, err)
	c.produce(mixedEvents(topic, 0, 1)...)

	src, err := Open(t.Context(), c.dbOffsetsConfig(group, topic))
	require.NoError(t, err)
	ccfg := consumerConfig("svc")
	ccfg.ShutdownTimeout = 500 * time.Millisecond
	r := startConsumer(t, db, src, ccfg, recordEffect)
	require.Eventually(t, func() bool { return r.c.Stats().Handled == 1 }, 30*time.Second, 10*time.Millisecond)

	locker, err := db.Begin(ctx)
	require.NoError(t, err)
	defer locker.Rollback(ctx) //nolint:errcheck
	_, err = locker.Exec(ctx, `LOCK TABLE processed_events_offsets IN EXCLUSIVE MODE`)
	require.NoError(t, err)
	c.produce(msg(topic, 0, "not json"))
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND datname = current_database() AND pid <> pg_backend_pid()
			AND query ILIKE '%processed_events_offsets%'`).Scan(&n))
		return n > 0
	}, 30*time.Second, 10*time.Millisecond, "the dead letter's record waits for the table")

	start := time.Now()
	require.NoError(t, r.stop())
	assert.Less(t, time.Since(start), 5*time.Second, "the stop outlasted ShutdownTimeout")
	assert.Equal(t, uint64(1), r.c.Stats().DeadLettered)
}
