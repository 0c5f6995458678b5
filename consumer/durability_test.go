package consumer_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// With synchronous_commit off (a common tuning for write-heavy work)
// PostgreSQL acknowledges a COMMIT before it is on disk, and the consumer
// acks the message then: a crash of the database loses effects whose
// messages the broker no longer holds, and nothing said so. The consumer
// warns at start, naming the setting; so it does for fsync off. A consumer
// whose sessions commit durably gets no synchronous_commit warning.
func TestCommitsThatAreNotDurableAreWarnedOfAtStart(t *testing.T) {
	admin, schema := pgtest.Schema(t)
	effects(t, admin)
	var fsync string
	require.NoError(t, admin.QueryRow(context.Background(), `SHOW fsync`).Scan(&fsync))
	warnings := func(t *testing.T, syncCommit string) string {
		t.Helper()
		pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
			c.ConnConfig.RuntimeParams["synchronous_commit"] = syncCommit
		})
		return startWarnings(t, pool, "durability-"+syncCommit)
	}
	off := warnings(t, "off")
	assert.Contains(t, off, "synchronous_commit is off")
	assert.Contains(t, off, "synchronous_commit=off")
	on := warnings(t, "on")
	assert.NotContains(t, on, "synchronous_commit is off")
	for _, logged := range []string{off, on} {
		assert.Equal(t, fsync == "off", strings.Contains(logged, "fsync is off"), "the server's fsync is %s", fsync)
	}
}

// A processed-events table made UNLOGGED (for speed) is emptied by
// PostgreSQL after a crash, while the handlers' tables keep their effects:
// every redelivery after it is handled again. The consumer warns at start,
// naming the table.
func TestUnloggedStoreTableIsWarnedOfAtStart(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	assert.NotContains(t, startWarnings(t, pool, "unlogged"), "UNLOGGED", "the tables Migrate made are logged")
	_, err := pool.Exec(context.Background(), `ALTER TABLE processed_events SET UNLOGGED`)
	require.NoError(t, err)
	logged := startWarnings(t, pool, "unlogged")
	assert.Contains(t, logged, "UNLOGGED")
	assert.Contains(t, logged, "processed_events")
}

// startWarnings runs a consumer named name on pool until it handled one
// message, and returns what it logged at level Warn and above.
func startWarnings(t *testing.T, pool *pgxpool.Pool, name string) string {
	t.Helper()
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "e1", 1)
	var logs bytes.Buffer
	var mu sync.Mutex
	cfg := fastConfig(name)
	cfg.Telemetry.Logger = slog.New(slog.NewTextHandler(lockedWriter{&logs, &mu}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, time.Millisecond, "the consumer runs")
	require.NoError(t, stop())
	mu.Lock()
	defer mu.Unlock()
	return logs.String()
}

// PostgreSQL empties an UNLOGGED partition after a crash as it does an
// UNLOGGED table; a processed-events table partitioned by a hash of the
// event id (which the store's check accepts) whose partitions were made
// UNLOGGED for speed forgot its claims at a crash without a word: the
// parent, which holds no rows, is logged, and only it was looked at. Each
// such partition is named.
func TestUnloggedPartitionOfAStoreTableIsWarnedOfAtStart(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	_, err := pool.Exec(context.Background(), `CREATE TABLE processed_events (
	consumer text NOT NULL, event_id text NOT NULL, fingerprint bytea,
	processed_at timestamptz NOT NULL DEFAULT now(), source text NOT NULL DEFAULT '',
	partition integer, "offset" bigint, PRIMARY KEY (consumer, event_id)
) PARTITION BY HASH (event_id);
CREATE TABLE processed_events_p0 PARTITION OF processed_events FOR VALUES WITH (MODULUS 2, REMAINDER 0);
CREATE UNLOGGED TABLE processed_events_p1 PARTITION OF processed_events FOR VALUES WITH (MODULUS 2, REMAINDER 1)`)
	require.NoError(t, err)
	logged := startWarnings(t, pool, "unlogged-partition")
	assert.Contains(t, logged, "UNLOGGED")
	assert.Contains(t, logged, "processed_events_p1")
	assert.NotContains(t, logged, "processed_events_p0", "a logged partition is not named")
}
