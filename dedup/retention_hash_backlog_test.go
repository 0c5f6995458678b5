package dedup_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// On a table partitioned by a hash of the event id, a retention statement
// deletes beside each row it chose the expired rows of the same ctid in
// the other partitions, whatever their age. The next statement started
// from the newest of the rows deleted: where the partitions hold rows of
// other ages at the same ctids (loaded in id order, as here, or written
// into space VACUUM freed), that passed over most of the expired rows, and
// the sweep ended with 179 of 4,000 deleted and no error; each sweep after
// did about as little, and the table grew past its window. A sweep deletes
// every expired row of the consumer, and only those.
func TestRetentionOnHashPartitionedTableDeletesTheWholeBacklog(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(ctx, `CREATE TABLE processed_events (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL,
    fingerprint  bytea,
    processed_at timestamptz NOT NULL DEFAULT now(),
    source       text        NOT NULL DEFAULT '',
    partition    integer,
    "offset"     bigint,
    PRIMARY KEY (consumer, event_id)
) PARTITION BY HASH (event_id);
CREATE TABLE processed_events_p0 PARTITION OF processed_events FOR VALUES WITH (MODULUS 2, REMAINDER 0);
CREATE TABLE processed_events_p1 PARTITION OF processed_events FOR VALUES WITH (MODULUS 2, REMAINDER 1)`)
	require.NoError(t, err)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	// A backlog of 4,000 expired rows a minute apart, loaded in id order
	// ('e-1', 'e-10', 'e-100', ...): each partition's ctids follow the
	// ids, not the ages. And young rows of the same consumer, to keep.
	_, err = pool.Exec(ctx, `INSERT INTO processed_events (consumer, event_id, processed_at)
SELECT 'c', 'e-' || i, now() - interval '30 days' + i * interval '1 minute' FROM generate_series(1, 4000) i ORDER BY 2;
INSERT INTO processed_events (consumer, event_id) SELECT 'c', 'y-' || i FROM generate_series(1, 50) i`)
	require.NoError(t, err)

	n, err := s.DeleteOlderThan(ctx, pool, "c", time.Now().Add(-time.Hour), 100)
	require.NoError(t, err)
	assert.Equal(t, int64(4000), n, "rows deleted by one sweep")
	assert.Equal(t, 0, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events WHERE event_id LIKE 'e-%'`),
		"expired rows left after the sweep")
	assert.Equal(t, 50, rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events WHERE event_id LIKE 'y-%'`),
		"young rows kept")
}
