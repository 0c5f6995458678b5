package main

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// The tables of a release before versions were recorded have the shape of
// version 1: no crashes or last_error in the attempts table. migrate up
// adopts them (version 1, then 2..5 add the rest), but migrate status
// compared them with the newest shape and said "the table of that name is
// not the store's (migrate up and a consumer's start refuse it)", with a
// shape_error in -json: an operator told that the service's own table is
// another library's, and that migrating would fail, when it would not.
func TestMigrateStatusKnowsTheTablesOfAnUnversionedRelease(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	_, err := pool.Exec(ctx, `
CREATE TABLE processed_events (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL,
    fingerprint  bytea,
    processed_at timestamptz NOT NULL DEFAULT now(),
    source       text        NOT NULL DEFAULT '',
    partition    integer,
    "offset"     bigint,
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX processed_events_processed_at_idx ON processed_events (processed_at);
CREATE TABLE processed_events_attempts (
    consumer  text        NOT NULL,
    event_id  text        NOT NULL,
    attempts  integer     NOT NULL,
    last_seen timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);`)
	require.NoError(t, err)
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}

	code, out, errOut := cli(t, env, "migrate", "status")
	require.Equal(t, exitOK, code, errOut)
	assert.NotContains(t, out, "not the store's", "the tables of an older release of this library")
	code, out, errOut = cli(t, env, "migrate", "status", "-json")
	require.Equal(t, exitOK, code, errOut)
	var rep map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	assert.Nil(t, rep["shape_error"])

	// What status said migrate up would refuse, it does.
	code, _, errOut = cli(t, env, "migrate", "up")
	require.Equal(t, exitOK, code, errOut)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	v, err := store.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, dedup.SchemaVersion, v)
}
