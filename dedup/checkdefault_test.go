package dedup_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// The store's inserts leave processed_at and last_seen out, for their
// default (now()) to fill. Tables made by hand (Config.SkipMigrate, a
// DBA's DDL) without those defaults passed Check and Migrate: every claim
// stored a NULL processed_at, which retention never deleted (NULL is not
// older than any cutoff, so the table grew without bound) and which the
// lookup of a duplicate could not read (every redelivery's claim failed);
// every crash-guard record was refused (last_seen NOT NULL). So was every
// claim without a partition (each RabbitMQ message's) in a table whose
// partition column is NOT NULL. Check and Migrate name each such column,
// and a table without them passes.
func TestCheckRefusesColumnsTheStoresWritesCannotFill(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(ctx, `CREATE TABLE processed_events (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL,
    fingerprint  bytea,
    processed_at timestamptz,
    source       text        NOT NULL DEFAULT '',
    partition    integer     NOT NULL,
    "offset"     bigint,
    PRIMARY KEY (consumer, event_id)
);
CREATE TABLE processed_events_attempts (
    consumer   text        NOT NULL,
    event_id   text        NOT NULL,
    attempts   integer     NOT NULL,
    last_seen  timestamptz NOT NULL,
    crashes    integer     NOT NULL DEFAULT 0,
    last_error jsonb,
    PRIMARY KEY (consumer, event_id)
)`)
	require.NoError(t, err)
	s, err := dedup.New(dedup.Config{})
	require.NoError(t, err)

	err = s.Check(ctx, pool)
	require.ErrorIs(t, err, dedup.ErrSchemaMismatch)
	assert.Contains(t, err.Error(), "column processed_at has no default")
	assert.Contains(t, err.Error(), "column last_seen has no default")
	assert.Contains(t, err.Error(), "column partition is NOT NULL, and the store writes NULL there")
	err = s.Migrate(ctx, pool)
	require.ErrorIs(t, err, dedup.ErrSchemaMismatch, "Migrate adopts no such table")
	assert.True(t, strings.Contains(err.Error(), "processed_at"), "%v", err)

	_, err = pool.Exec(ctx, `ALTER TABLE processed_events ALTER COLUMN processed_at SET DEFAULT now(), ALTER COLUMN partition DROP NOT NULL;
ALTER TABLE processed_events_attempts ALTER COLUMN last_seen SET DEFAULT now()`)
	require.NoError(t, err)
	require.NoError(t, s.Check(ctx, pool))
	require.NoError(t, s.Migrate(ctx, pool))
	c := dedup.Claim{Consumer: "c", EventID: "e", Source: "queue", Partition: -1, Offset: -1}
	claimTx(t, ctx, pool, s, c)
	assert.Equal(t, dedup.Duplicate, claimTx(t, ctx, pool, s, c).Outcome)
	n, err := s.DeleteOlderThan(ctx, pool, "c", time.Now().Add(time.Hour), 0)
	require.NoError(t, err)
	assert.Equal(t, int64(1), n, "retention deletes the claim once it is old enough")
}
