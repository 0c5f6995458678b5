package outbox_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
)

// syncBuffer is a bytes.Buffer safe for the relay's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *syncBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// An outbox table made UNLOGGED (for speed) is emptied by PostgreSQL
// after a crash, while the tables written beside its rows keep their
// changes: the messages of committed transactions not yet published are
// lost. The relay warns at start, naming the table; a logged table gets
// no warning.
func TestUnloggedOutboxTableIsWarnedOfAtStart(t *testing.T) {
	pool, _ := migrated(t)
	run := func(t *testing.T) string {
		t.Helper()
		var logs syncBuffer
		r, stop := startRelay(t, pool, nopPublisher{}, outbox.RelayConfig{PollInterval: 20 * time.Millisecond,
			Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
		require.Eventually(t, r.Leader, 10*time.Second, 5*time.Millisecond, "the relay runs")
		stop()
		return logs.String()
	}
	assert.NotContains(t, run(t), "UNLOGGED", "the table Migrate made is logged")
	_, err := pool.Exec(context.Background(), `ALTER TABLE outbox SET UNLOGGED`)
	require.NoError(t, err)
	logged := run(t)
	assert.Contains(t, logged, "UNLOGGED")
	assert.True(t, strings.Contains(logged, "outbox"), logged)
}

// The warning read the outbox table's own persistence only: an outbox
// partitioned by ranges of seq (which Migrate takes as it is) whose
// partitions were created UNLOGGED for speed got no warning, its parent,
// which holds no rows, being logged, though PostgreSQL empties those
// partitions after a crash as it empties an UNLOGGED table. The
// partitions are read too, and each unlogged one is named.
func TestUnloggedPartitionOfTheOutboxIsWarnedOfAtStart(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE outbox (
    seq         bigint      GENERATED ALWAYS AS IDENTITY,
    event_id    text        NOT NULL,
    topic       text        NOT NULL,
    routing_key text        NOT NULL DEFAULT '',
    key         bytea,
    type        text        NOT NULL DEFAULT '',
    headers     jsonb       NOT NULL DEFAULT '{}',
    trace       jsonb       NOT NULL DEFAULT '{}',
    body        bytea       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    attempts    integer     NOT NULL DEFAULT 0,
    not_before  timestamptz,
    last_error  text,
    parked_at   timestamptz,
    sent_at     timestamptz,
    PRIMARY KEY (seq)
) PARTITION BY RANGE (seq);
CREATE TABLE outbox_logged PARTITION OF outbox FOR VALUES FROM (MINVALUE) TO (1000);
CREATE UNLOGGED TABLE outbox_fast PARTITION OF outbox FOR VALUES FROM (1000) TO (MAXVALUE)`)
	require.NoError(t, err)
	require.NoError(t, outbox.Migrate(ctx, pool))
	var logs syncBuffer
	r, stop := startRelay(t, pool, nopPublisher{}, outbox.RelayConfig{PollInterval: 20 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	require.Eventually(t, r.Leader, 30*time.Second, 5*time.Millisecond, "the relay runs")
	stop()
	logged := logs.String()
	assert.Contains(t, logged, "UNLOGGED")
	assert.Contains(t, logged, "table=outbox_fast", "the unlogged partition is named")
	assert.NotContains(t, logged, "table=outbox_logged", "a logged partition is not")
}
