package main

import (
	"context"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceco/once/oncetest"
)

// The demo's own verdict (exactly-once ledger, poison dead-lettered) must
// pass; run returns an error when it does not.
func TestDemoVerdictPasses(t *testing.T) {
	t.Setenv("DATABASE_URL", oncetest.URL(t))
	require.NoError(t, run(600))
}

// With nothing published there is no crash to recover from: the demo must
// not pass as if it had shown one.
func TestDemoFailsWhenNoAckWasLost(t *testing.T) {
	t.Setenv("DATABASE_URL", oncetest.URL(t))
	err := run(0)
	require.Error(t, err)
	require.Contains(t, err.Error(), "redelivered")
}

// The demo runs again on the database it ran on (DATABASE_URL): it
// dropped the library's tables, whose versions once_schema_versions
// still recorded, so the second run's consumer did not create them again
// and failed ("processed_events" does not exist). It keeps its tables in
// a schema of its own, made afresh, and leaves the database's other
// tables alone (a service's "ledger" beside it).
func TestDemoRunsAgainOnTheSameDatabase(t *testing.T) {
	// The database's sessions start in a schema of the test's own, with a
	// service's table of the demo's name in it: where the demo's
	// unqualified names went.
	pool := oncetest.Postgres(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE ledger (note text); INSERT INTO ledger VALUES ('a service''s own')`)
	require.NoError(t, err)
	t.Setenv("DATABASE_URL", withSearchPath(oncetest.URL(t), pool.Config().ConnConfig.RuntimeParams["search_path"]))

	require.NoError(t, run(300), "first run")
	require.NoError(t, run(300), "second run, on the tables the first left")
	var note string
	require.NoError(t, pool.QueryRow(ctx, `SELECT note FROM ledger`).Scan(&note), "the service's table beside the demo's")
	require.Equal(t, "a service's own", note)
}

// withSearchPath returns the connection string dsn (a URL or key=value
// pairs) with its sessions' search_path set to schema.
func withSearchPath(dsn, schema string) string {
	if !strings.Contains(dsn, "://") {
		return dsn + " search_path=" + schema
	}
	u, err := url.Parse(dsn)
	if err != nil {
		return dsn
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String()
}
