package dedup

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// TestStatementsLookUpIDsByIndex guards the plans of the batch statements
// against stale statistics, the normal state of a table that grows faster
// than autovacuum analyzes it. With the statistics of an empty table, a
// plain join on (consumer, event_id) is planned as a scan of every
// row of that consumer, hashed, which made a batch claim grow from 1 ms to
// 5 ms over the first 20,000 events. Each statement must reach the table
// only through per-id index lookups, whatever the statistics say.
func TestStatementsLookUpIDsByIndex(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, _ := pgtest.Schema(t)
	s, err := New(Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))

	// 20,000 rows of consumer c in a table never analyzed: its planner
	// statistics are those of an empty table.
	// (The attempts table holds only the counts of messages in flight.)
	for _, sql := range []string{
		`ALTER TABLE processed_events SET (autovacuum_enabled = false)`,
		`INSERT INTO processed_events (consumer, event_id) SELECT 'c', 'e-' || i FROM generate_series(1, 20000) i`,
	} {
		_, err := pool.Exec(ctx, sql)
		require.NoError(t, err, sql)
	}

	ids := make([]string, 80)
	for i := range ids {
		ids[i] = fmt.Sprintf(`"e-%d"`, 10000+i*3)
	}
	idArray := `'{` + strings.Join(ids, ",") + `}'::text[]`
	nulls := func(typ string) string {
		return `array_fill(NULL::` + typ + `, ARRAY[` + fmt.Sprint(len(ids)) + `])`
	}
	for name, stmt := range map[string]struct{ sql, types, args string }{
		"claim batch": {s.claimBatchSQL, "text, text[], bytea[], text[], integer[], bigint[]",
			"'c', " + idArray + ", " + nulls("bytea") + ", " + nulls("text") + ", " + nulls("integer") + ", " + nulls("bigint")},
	} {
		t.Run(name, func(t *testing.T) {
			plan := explainExecute(t, ctx, pool, stmt.sql, stmt.types, stmt.args)
			assert.NotRegexp(t, `(Seq|Bitmap Heap) Scan on processed_events( |$)`, plan, "plan:\n%s", plan)
			assert.Regexp(t, `Index (Only )?Scan using processed_events_pkey`, plan, "plan:\n%s", plan)
		})
	}
}

// Retention reaches one consumer's old rows through the (consumer,
// processed_at) index, not by scanning every consumer's rows: here another
// consumer's 20,000 rows share the table, none of them old.
func TestRetentionUsesConsumerIndex(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, _ := pgtest.Schema(t)
	s, err := New(Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	for _, sql := range []string{
		`INSERT INTO processed_events (consumer, event_id) SELECT 'other', 'e-' || i FROM generate_series(1, 20000) i`,
		`INSERT INTO processed_events (consumer, event_id, processed_at)
SELECT 'c1', 'e-' || i, now() - i * interval '1 hour' FROM generate_series(1, 200) i`,
	} {
		_, err := pool.Exec(ctx, sql)
		require.NoError(t, err, sql)
	}
	_, err = pool.Exec(ctx, `ANALYZE processed_events`)
	require.NoError(t, err)

	plan := explainExecute(t, ctx, pool, s.retentionSQL, "text, timestamptz, integer, timestamptz", "'c1', now() - interval '4 days', 1000, '-infinity'")
	assert.Regexp(t, `Index (Only )?Scan using processed_events_consumer_processed_at_idx`, plan, "plan:\n%s", plan)
	assert.NotRegexp(t, `Seq Scan on processed_events( |$)`, plan, "plan:\n%s", plan)
}

// explainExecute prepares sql with the given parameter types and returns
// the plan of executing it with args, as chosen for a client's prepared
// statement on its first executions (a custom plan).
func explainExecute(t *testing.T, ctx context.Context, pool *pgxpool.Pool, sql, types, args string) string {
	t.Helper()
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, `PREPARE stmt(`+types+`) AS `+sql)
	require.NoError(t, err)
	defer conn.Exec(ctx, `DEALLOCATE stmt`) //nolint:errcheck // the connection is reset on release
	rows, err := conn.Query(ctx, `EXPLAIN EXECUTE stmt(`+args+`)`)
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return strings.Join(lines, "\n")
}

// Retention walks the (consumer, processed_at) index in order also when
// most of the consumer's rows are expired, the normal state of a first
// sweep or one after an outage. With a plain LIMIT over "processed_at <
// cutoff", the planner expects thousands of matches and takes the LIMIT
// from a sequential scan: each statement then starts at the table's first
// page and walks past the rows the previous statements deleted, so a
// sweep's cost grows with the square of what it deletes (seconds per
// statement at 10M rows, docs/performance.md).
func TestRetentionWalksTheIndexWhenMostRowsExpired(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, _ := pgtest.Schema(t)
	s, err := New(Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	for _, sql := range []string{
		`INSERT INTO processed_events (consumer, event_id, processed_at)
SELECT 'c1', 'e-' || i, now() - interval '30 days' + i * interval '1 second' FROM generate_series(1, 100000) i`,
		`ANALYZE processed_events`,
	} {
		_, err := pool.Exec(ctx, sql)
		require.NoError(t, err, sql)
	}
	plan := explainExecute(t, ctx, pool, s.retentionSQL, "text, timestamptz, integer, timestamptz",
		"'c1', now() - interval '1 day', 1000, '-infinity'")
	assert.Regexp(t, `Index (Only )?Scan using processed_events_consumer_processed_at_idx`, plan, "plan:\n%s", plan)
	assert.NotRegexp(t, `Seq Scan on processed_events( |$)`, plan, "plan:\n%s", plan)
}
