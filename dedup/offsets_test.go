package dedup_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
)

// recordTx runs RecordOffsets for u in a transaction of its own.
func recordTx(t testing.TB, ctx context.Context, pool *pgxpool.Pool, s *dedup.Store, u dedup.OffsetsUpdate) error {
	t.Helper()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after Commit
	if err := s.RecordOffsets(ctx, tx, "c", u); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// takeOver takes partition 0 of topic "t" over and returns its row.
func takeOver(t testing.TB, ctx context.Context, pool *pgxpool.Pool, s *dedup.Store, topicID string) dedup.PartitionOffsets {
	t.Helper()
	got, err := s.TakeOverPartitions(ctx, pool, "c", dedup.Owner{Group: "g", Generation: 1},
		[]dedup.PartitionKey{{Topic: "t", Partition: 0, TopicID: topicID}})
	require.NoError(t, err)
	require.Len(t, got, 1)
	return got[0]
}

// Offsets finished out of order are kept above the contiguous prefix, and
// the prefix moves over them once the gap below is done.
func TestRecordOffsetsKeepsWhatIsDoneAboveThePrefix(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	o := takeOver(t, ctx, pool, s, "")
	assert.Equal(t, int64(-1), o.Next, "a new row knows nothing")
	u := dedup.OffsetsUpdate{Topic: "t", Partition: 0, Epoch: o.Epoch, DoneBelow: 10}

	u.Done = []int64{12, 14}
	require.NoError(t, recordTx(t, ctx, pool, s, u))
	o = takeOver(t, ctx, pool, s, "")
	assert.Equal(t, int64(10), o.Next)
	assert.Equal(t, []int64{12, 14}, o.Done)

	u.Epoch, u.Done = o.Epoch, []int64{10, 11}
	require.NoError(t, recordTx(t, ctx, pool, s, u))
	o = takeOver(t, ctx, pool, s, "")
	assert.Equal(t, int64(13), o.Next, "10, 11 and 12 are done")
	assert.Equal(t, []int64{14}, o.Done)

	u.Epoch, u.Done, u.DoneBelow = o.Epoch, []int64{13}, 5
	require.NoError(t, recordTx(t, ctx, pool, s, u))
	o = takeOver(t, ctx, pool, s, "")
	assert.Equal(t, int64(15), o.Next, "a lower DoneBelow never moves the prefix back")
	assert.Empty(t, o.Done)
}

// A rolled-back transaction records nothing.
func TestRecordOffsetsRolledBack(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	o := takeOver(t, ctx, pool, s, "")
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, s.RecordOffsets(ctx, tx, "c", dedup.OffsetsUpdate{Topic: "t", Epoch: o.Epoch, DoneBelow: 3, Done: []int64{3}}))
	require.NoError(t, tx.Rollback(ctx))
	o = takeOver(t, ctx, pool, s, "")
	assert.Equal(t, int64(-1), o.Next)
	assert.Empty(t, o.Done)
}

// An owner whose partition was taken over cannot write its progress, not
// even in a transaction it began before the take-over: the take-over waits
// for the row it holds, and its write then finds a newer epoch.
func TestRecordOffsetsFencedAfterTakeOver(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	old := takeOver(t, ctx, pool, s, "")
	newer := takeOver(t, ctx, pool, s, "")
	assert.Greater(t, newer.Epoch, old.Epoch)
	err := recordTx(t, ctx, pool, s, dedup.OffsetsUpdate{Topic: "t", Epoch: old.Epoch, DoneBelow: 7, Done: []int64{7}})
	require.ErrorIs(t, err, dedup.ErrFenced)
	require.NoError(t, recordTx(t, ctx, pool, s, dedup.OffsetsUpdate{Topic: "t", Epoch: newer.Epoch, DoneBelow: 2}))

	// The old owner writes first and holds the row; the take-over waits for
	// its commit and returns what it committed.
	o := takeOver(t, ctx, pool, s, "")
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after Commit
	require.NoError(t, s.RecordOffsets(ctx, tx, "c", dedup.OffsetsUpdate{Topic: "t", Epoch: o.Epoch, DoneBelow: 2, Done: []int64{2, 3}}))
	took := make(chan dedup.PartitionOffsets, 1)
	go func() {
		got, err := s.TakeOverPartitions(ctx, pool, "c", dedup.Owner{Group: "g", Generation: 2},
			[]dedup.PartitionKey{{Topic: "t", Partition: 0}})
		if err == nil {
			took <- got[0]
		}
		close(took)
	}()
	waitForLockWait(t, ctx, pool)
	require.NoError(t, tx.Commit(ctx))
	got := <-took
	assert.Equal(t, int64(4), got.Next, "the take-over read what the old owner committed")
	err = recordTx(t, ctx, pool, s, dedup.OffsetsUpdate{Topic: "t", Epoch: o.Epoch, DoneBelow: 4, Done: []int64{4}})
	assert.True(t, errors.Is(err, dedup.ErrFenced), "the old owner's next write: %v", err)
}

// waitForLockWait returns once some session of the database waits for a
// lock.
func waitForLockWait(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	t.Helper()
	require.Eventually(t, func() bool {
		return rowCount(t, ctx, pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`) > 0
	}, time.Minute, 5*time.Millisecond)
}

// A topic deleted and created again under the same name numbers its
// offsets from 0 again: a row of the old topic's id starts afresh.
func TestTakeOverForgetsAnotherTopicsOffsets(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	o := takeOver(t, ctx, pool, s, "id-1")
	require.NoError(t, recordTx(t, ctx, pool, s, dedup.OffsetsUpdate{Topic: "t", Epoch: o.Epoch, DoneBelow: 50, Done: []int64{52}}))
	o = takeOver(t, ctx, pool, s, "id-1")
	assert.Equal(t, int64(50), o.Next)
	o = takeOver(t, ctx, pool, s, "id-2")
	assert.Equal(t, int64(-1), o.Next)
	assert.Empty(t, o.Done)
}

// A topic id unknown on one side (a cluster, or a Sarama.Version, without
// topic ids; one that gains them by an upgrade) says nothing of the topic:
// the take-over keeps the row's progress, so that the records below it,
// those without ids above all, are not handled again.
func TestTakeOverKeepsOffsetsWhenATopicIDIsUnknown(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	o := takeOver(t, ctx, pool, s, "")
	require.NoError(t, recordTx(t, ctx, pool, s, dedup.OffsetsUpdate{Topic: "t", Epoch: o.Epoch, DoneBelow: 50, Done: []int64{52}}))
	o = takeOver(t, ctx, pool, s, "id-1")
	assert.Equal(t, int64(50), o.Next, "ids known from now on")
	assert.Equal(t, []int64{52}, o.Done)
	assert.Equal(t, "id-1", o.TopicID)
	o = takeOver(t, ctx, pool, s, "")
	assert.Equal(t, int64(50), o.Next, "ids unknown again")
	assert.Equal(t, "", o.TopicID, "the part's own")
	o = takeOver(t, ctx, pool, s, "id-2")
	assert.Equal(t, int64(-1), o.Next, "the row kept id-1: id-2 is another topic")
	assert.Empty(t, o.Done)
}

// CheckOffsets names a missing offsets table.
func TestCheckOffsets(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	require.NoError(t, s.CheckOffsets(ctx, pool))
	_, err := pool.Exec(ctx, `DROP TABLE processed_events_offsets`)
	require.NoError(t, err)
	err = s.CheckOffsets(ctx, pool)
	require.ErrorIs(t, err, dedup.ErrSchemaMismatch)
	assert.Contains(t, err.Error(), "processed_events_offsets")
}

// An offsets table without its key on (consumer, topic, partition), made
// by other tools, fails CheckOffsets (and so the source's start) instead
// of every take-over, which the source would retry without end, consuming
// nothing.
func TestCheckOffsetsNeedsTheTakeOversKey(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	_, err := pool.Exec(ctx, `ALTER TABLE processed_events_offsets DROP CONSTRAINT processed_events_offsets_pkey`)
	require.NoError(t, err)
	_, err = s.TakeOverPartitions(ctx, pool, "c", dedup.Owner{Group: "g", Generation: 1},
		[]dedup.PartitionKey{{Topic: "t", Partition: 0}})
	require.Error(t, err, "a take-over needs the key")

	err = s.CheckOffsets(ctx, pool)
	require.ErrorIs(t, err, dedup.ErrSchemaMismatch)
	assert.Contains(t, err.Error(), "no primary key or unique index on (consumer, topic, partition)")

	// A unique index on the three columns, in any order, will do.
	_, err = pool.Exec(ctx, `CREATE UNIQUE INDEX ON processed_events_offsets (topic, partition, consumer)`)
	require.NoError(t, err)
	require.NoError(t, s.CheckOffsets(ctx, pool))
	o := takeOver(t, ctx, pool, s, "")
	assert.Equal(t, int64(-1), o.Next)
}

// OffsetDone reads a record's position as the row records it: below Next
// or among the offsets done above it, for the row's topic id only.
func TestOffsetDone(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	key := dedup.PartitionKey{Topic: "t", Partition: 0, TopicID: "id-1"}
	done := func(k dedup.PartitionKey, offset int64) bool {
		t.Helper()
		d, err := s.OffsetDone(ctx, pool, "c", k, offset)
		require.NoError(t, err)
		return d
	}
	assert.False(t, done(key, 0), "no row: nothing done")
	o := takeOver(t, ctx, pool, s, "id-1")
	require.NoError(t, recordTx(t, ctx, pool, s, dedup.OffsetsUpdate{Topic: "t", Partition: 0, Epoch: o.Epoch, DoneBelow: 5, Done: []int64{7}}))
	for offset, want := range map[int64]bool{0: true, 4: true, 5: false, 6: false, 7: true, 8: false} {
		assert.Equal(t, want, done(key, offset), "offset %d", offset)
	}
	assert.False(t, done(dedup.PartitionKey{Topic: "t", Partition: 0, TopicID: "id-2"}, 4), "another topic of the same name")
	assert.True(t, done(dedup.PartitionKey{Topic: "t", Partition: 0}, 4), "a topic id unknown says nothing of the topic")
	assert.False(t, done(dedup.PartitionKey{Topic: "t", Partition: 1, TopicID: "id-1"}, 4), "another partition")
	other, err := s.OffsetDone(ctx, pool, "other", key, 4)
	require.NoError(t, err)
	assert.False(t, other, "another consumer's row")
}

// CheckOffsetsPrivileges takes privileges granted on the table or on each
// of its columns, and names those missing.
func TestCheckOffsetsPrivileges(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	require.NoError(t, s.CheckOffsetsPrivileges(ctx, pool), "the owner")

	var schema string
	require.NoError(t, pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema))
	role := pgx.Identifier{"offsets_" + schema}.Sanitize()
	_, err := pool.Exec(ctx, `CREATE ROLE `+role+` NOLOGIN`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = pool.Exec(context.Background(), `DROP ROLE `+role)
	})
	const cols = `consumer, topic, partition, next_offset, done, epoch, topic_id, kafka_group, generation, updated_at`
	_, err = pool.Exec(ctx, `GRANT USAGE ON SCHEMA `+pgx.Identifier{schema}.Sanitize()+` TO `+role+`;
GRANT SELECT (`+cols+`), INSERT (`+cols+`), UPDATE (`+cols+`) ON processed_events_offsets TO `+role)
	require.NoError(t, err)

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	defer conn.Exec(context.Background(), `RESET ROLE`) //nolint:errcheck // the connection goes back to the pool
	_, err = conn.Exec(ctx, `SET ROLE `+role)
	require.NoError(t, err)
	require.NoError(t, s.CheckOffsetsPrivileges(ctx, conn), "every column granted")
	got, err := s.TakeOverPartitions(ctx, conn, "c", dedup.Owner{Group: "g", Generation: 1}, []dedup.PartitionKey{{Topic: "t"}})
	require.NoError(t, err, "what the check lets through works")
	require.NoError(t, s.RecordOffsets(ctx, conn, "c", dedup.OffsetsUpdate{Topic: "t", Epoch: got[0].Epoch, DoneBelow: -1, Done: []int64{0}}))

	_, err = pool.Exec(ctx, `REVOKE UPDATE (epoch) ON processed_events_offsets FROM `+role)
	require.NoError(t, err)
	err = s.CheckOffsetsPrivileges(ctx, conn)
	require.Error(t, err)
	assert.Contains(t, err.Error(), `lacks UPDATE on "processed_events_offsets"`)
	_, err = s.TakeOverPartitions(ctx, conn, "c", dedup.Owner{Group: "g", Generation: 2}, []dedup.PartitionKey{{Topic: "t"}})
	require.Error(t, err, "what the check refuses fails")
}

// A take-over leaves next_offset, done, epoch and updated_at out, for
// their defaults to fill. An offsets table made by other tools without
// them passed CheckOffsets (and so the source's start), and every
// take-over failed: a NULL next_offset or epoch cannot be read back, and
// done or updated_at NOT NULL refuses the row; the source retried it
// without end, consuming nothing. CheckOffsets names each such column.
func TestCheckOffsetsRefusesColumnsATakeOverCannotFill(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	_, err := pool.Exec(ctx, `ALTER TABLE processed_events_offsets
	ALTER COLUMN next_offset DROP DEFAULT, ALTER COLUMN next_offset DROP NOT NULL,
	ALTER COLUMN epoch DROP DEFAULT, ALTER COLUMN epoch DROP NOT NULL`)
	require.NoError(t, err)
	_, err = s.TakeOverPartitions(ctx, pool, "c", dedup.Owner{Group: "g", Generation: 1},
		[]dedup.PartitionKey{{Topic: "t", Partition: 0}})
	require.ErrorContains(t, err, "NULL", "a take-over reads next_offset and epoch back")
	_, err = pool.Exec(ctx, `DELETE FROM processed_events_offsets;
ALTER TABLE processed_events_offsets ALTER COLUMN updated_at DROP DEFAULT`)
	require.NoError(t, err)
	_, err = s.TakeOverPartitions(ctx, pool, "c", dedup.Owner{Group: "g", Generation: 1},
		[]dedup.PartitionKey{{Topic: "t", Partition: 0}})
	require.ErrorContains(t, err, "23502", "updated_at NOT NULL refuses the new row")

	err = s.CheckOffsets(ctx, pool)
	require.ErrorIs(t, err, dedup.ErrSchemaMismatch)
	for _, col := range []string{"next_offset", "epoch", "updated_at"} {
		assert.Contains(t, err.Error(), "column "+col+" has no default")
	}
	require.ErrorIs(t, s.Migrate(ctx, pool), dedup.ErrSchemaMismatch, "Migrate verifies the offsets table too")

	_, err = pool.Exec(ctx, `ALTER TABLE processed_events_offsets ALTER COLUMN next_offset SET DEFAULT -1,
	ALTER COLUMN epoch SET DEFAULT 1, ALTER COLUMN updated_at SET DEFAULT now()`)
	require.NoError(t, err)
	require.NoError(t, s.CheckOffsets(ctx, pool))
	o := takeOver(t, ctx, pool, s, "")
	assert.Equal(t, int64(-1), o.Next)
	require.NoError(t, recordTx(t, ctx, pool, s, dedup.OffsetsUpdate{Topic: "t", Partition: 0, Epoch: o.Epoch, DoneBelow: 3}))
}

// A new row's next_offset comes from the column's default, and -1 says the
// table knows nothing of the partition (the group's committed offset, or
// InitialOffset, applies). An offsets table made by other tools with
// another default (0, an offset's natural start) passed CheckOffsets, and
// every partition new to the table was taken for done below that offset:
// the source moved the group back to it, past its committed offset and
// StartNewest, and handled the partition's whole history again, the
// effects of records whose claims retention had deleted twice.
// CheckOffsets names the default.
func TestCheckOffsetsRefusesANextOffsetDefaultOtherThanNothingKnown(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	_, err := pool.Exec(ctx, `ALTER TABLE processed_events_offsets ALTER COLUMN next_offset SET DEFAULT 0`)
	require.NoError(t, err)
	assert.Equal(t, int64(0), takeOver(t, ctx, pool, s, "").Next, "a new row records the default as done below it")

	err = s.CheckOffsets(ctx, pool)
	require.ErrorIs(t, err, dedup.ErrSchemaMismatch)
	assert.Contains(t, err.Error(), "column next_offset's default is 0")

	for _, def := range []string{"-1", "'-1'::bigint", "(-1)::integer"} {
		_, err = pool.Exec(ctx, `ALTER TABLE processed_events_offsets ALTER COLUMN next_offset SET DEFAULT `+def)
		require.NoError(t, err)
		require.NoError(t, s.CheckOffsets(ctx, pool), "default %s", def)
	}
}
