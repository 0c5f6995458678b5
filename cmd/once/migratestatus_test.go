package main

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// migrate status said "schema version 0 of N" both where there are no
// tables and where the tables were made by another tool (goose,
// golang-migrate, the SQL run by hand, an unversioned release), which
// record no version in once_schema_versions: read as "no tables", or as
// tables to create. It now says which, and whether a table of that name is
// the store's.
func TestMigrateStatusTellsUnrecordedTablesFromNone(t *testing.T) {
	ctx := context.Background()
	status := func(env map[string]string, args ...string) string {
		t.Helper()
		code, out, errOut := cli(t, env, append([]string{"migrate", "status"}, args...)...)
		require.Equal(t, exitOK, code, errOut)
		return out
	}
	report := func(env map[string]string) map[string]any {
		t.Helper()
		var rep map[string]any
		require.NoError(t, json.Unmarshal([]byte(status(env, "-json")), &rep))
		return rep
	}

	_, none := pgtest.Schema(t)
	noneEnv := map[string]string{"DATABASE_URL": testenv.SchemaURL(none)}
	assert.Contains(t, status(noneEnv), "no tables")
	assert.Equal(t, false, report(noneEnv)["tables_exist"])

	// The schema's SQL run by another tool: every table, no version
	// recorded.
	pool, byHand := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, store.SchemaSQL())
	require.NoError(t, err)
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(byHand)}
	out := status(env)
	assert.NotContains(t, out, "no tables")
	assert.Contains(t, out, "no schema version recorded")
	assert.Contains(t, out, "the store's shape")
	rep := report(env)
	assert.Equal(t, true, rep["tables_exist"])
	assert.EqualValues(t, 0, rep["version"])

	// Another library's table of the name.
	pool, other := pgtest.Schema(t)
	_, err = pool.Exec(ctx, `CREATE TABLE processed_events (id bigint PRIMARY KEY, handled_at timestamptz)`)
	require.NoError(t, err)
	env = map[string]string{"DATABASE_URL": testenv.SchemaURL(other)}
	out = status(env)
	assert.Contains(t, out, "not the store's")
	rep = report(env)
	assert.Equal(t, true, rep["tables_exist"])
	assert.NotEmpty(t, rep["shape_error"])

	// Recorded: as before.
	code, _, errOut := cli(t, noneEnv, "migrate", "up")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, status(noneEnv), fmt.Sprintf("schema version %d of %d", dedup.SchemaVersion, dedup.SchemaVersion))
	assert.Equal(t, true, report(noneEnv)["tables_exist"])
}

// A table dropped by hand after its version was recorded (the attempts
// table, to clear the crash guard's records) left migrate status saying
// "schema version N of N", as if all were well, while every consumer's
// start failed on it. Status names what is missing, and migrate up makes
// it again.
func TestMigrateStatusTellsATableDroppedAfterItsVersion(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}
	code, _, errOut := cli(t, env, "migrate", "up")
	require.Equal(t, exitOK, code, errOut)
	_, err := pool.Exec(context.Background(), `DROP TABLE processed_events_attempts`)
	require.NoError(t, err)

	code, out, errOut := cli(t, env, "migrate", "status")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "processed_events_attempts")
	assert.Contains(t, out, "does not exist")
	code, out, errOut = cli(t, env, "migrate", "status", "-json")
	require.Equal(t, exitOK, code, errOut)
	var rep map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	assert.Contains(t, rep["shape_error"], "processed_events_attempts")

	code, _, errOut = cli(t, env, "migrate", "up")
	require.Equal(t, exitOK, code, errOut)
	code, out, errOut = cli(t, env, "migrate", "status")
	require.Equal(t, exitOK, code, errOut)
	assert.Equal(t, fmt.Sprintf("processed_events: schema version %d of %d\n", dedup.SchemaVersion, dedup.SchemaVersion), out)
}
