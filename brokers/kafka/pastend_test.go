package kafka

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
)

// With OffsetsInDatabase, a position the table records past the
// partition's end (the log truncated under it: an unclean leader
// election, a cluster restored from a backup) makes sarama start the
// claim at Config.InitialOffset, below the position. The records the
// claim then handled were not recorded: the table's position never moves
// back, so every transaction's offsets, below it, were dropped. A restart
// found the same position past the end, started at InitialOffset again,
// and handled every record without an id once more: each restart added an
// effect per record. The claim moves the row back to where it starts.
func TestOffsetsInDatabasePositionPastTheEndRecordsWhatItHandles(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	db := effectsDB(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background(), db))
	// The table's position is 10; the partition ends at 3.
	_, err = db.Exec(context.Background(), `INSERT INTO processed_events_offsets (consumer, topic, partition, next_offset) VALUES ('svc', $1, 0, 10)`, topic)
	require.NoError(t, err)
	c.produce(idless(topic, 0, 3)...)

	runToEnd(t, c, db, c.dbOffsetsConfig(group, topic), consumerConfig("svc"), 3)
	requireEachOnce(t, db, 3)
	assert.Equal(t, map[int32]int64{0: 3}, offsetsRows(t, db, topic), "the table records where the claim got to")

	c.produce(idless(topic, 3, 1)...)
	runToEnd(t, c, db, c.dbOffsetsConfig(group, topic), consumerConfig("svc"), 4)
	requireEachOnce(t, db, 4)
}

// The same when the database fails the claim's move of the row back once
// (a statement cut by its timeout, a connection lost at that moment): the
// failure was logged and the claim went on, its records handled but not
// recorded, since the row's position stayed past the end; after a restart,
// whose claim moved the row back, every record without an id was handled
// a second time. The move is retried, as a take-over is, before any
// record of the claim is handed out.
func TestOffsetsInDatabasePositionPastTheEndMovedBackAfterAFailure(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	db := effectsDB(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background(), db))
	_, err = db.Exec(context.Background(), `INSERT INTO processed_events_offsets (consumer, topic, partition, next_offset) VALUES ('svc', $1, 0, 10)`, topic)
	require.NoError(t, err)
	// The first update that moves a position back fails; a sequence,
	// whose values a failed statement does not take back, counts them.
	_, err = db.Exec(context.Background(), `CREATE SEQUENCE rewinds;
CREATE FUNCTION fail_first_rewind() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF NEW.next_offset < OLD.next_offset AND nextval('rewinds') = 1 THEN
		RAISE EXCEPTION 'canceling statement due to statement timeout' USING ERRCODE = '57014';
	END IF;
	RETURN NEW;
END $$;
CREATE TRIGGER fail_first_rewind BEFORE UPDATE ON processed_events_offsets FOR EACH ROW EXECUTE FUNCTION fail_first_rewind()`)
	require.NoError(t, err)
	c.produce(idless(topic, 0, 3)...)

	runToEnd(t, c, db, c.dbOffsetsConfig(group, topic), consumerConfig("svc"), 3)
	requireEachOnce(t, db, 3)
	var rewinds int64
	require.NoError(t, db.QueryRow(context.Background(), `SELECT last_value FROM rewinds`).Scan(&rewinds))
	require.GreaterOrEqual(t, rewinds, int64(1), "the move back was refused once")
	assert.Equal(t, map[int32]int64{0: 3}, offsetsRows(t, db, topic), "the table records where the claim got to")

	c.produce(idless(topic, 3, 1)...)
	runToEnd(t, c, db, c.dbOffsetsConfig(group, topic), consumerConfig("svc"), 4)
	requireEachOnce(t, db, 4)
}
