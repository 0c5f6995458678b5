package main

import (
	"context"
	"net/url"
	"strings"
	"testing"

	"github.com/onceco/once/oncetest"
)

// The demo shows a re-published batch: it passes only when the relay's
// session was killed and the batch went out again.
func TestDemoVerdictPasses(t *testing.T) {
	if err := run(600); err != nil {
		t.Fatalf("run: %v", err)
	}
}

// With one order there is one batch, never the third that the kill
// follows: the demo must not pass as if it had shown a re-published batch.
func TestDemoFailsWhenNoSessionWasKilled(t *testing.T) {
	err := run(1)
	if err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("run(1) = %v, want an error saying no relay session was killed", err)
	}
}

// The demo runs again on the database it ran on (DATABASE_URL): it
// dropped the library's tables, whose versions once_schema_versions
// still recorded, so the second run's outbox.Migrate did not create them
// again and failed ("outbox" does not exist). It keeps its tables in a
// schema of its own, made afresh, and leaves the database's other tables
// alone (a service's "outbox" beside it).
func TestDemoRunsAgainOnTheSameDatabase(t *testing.T) {
	// The database's sessions start in a schema of the test's own, with a
	// service's table of the demo's name in it: where the demo's
	// unqualified names went.
	pool := oncetest.Postgres(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE outbox (note text); INSERT INTO outbox VALUES ('a service''s own')`); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DATABASE_URL", withSearchPath(oncetest.URL(t), pool.Config().ConnConfig.RuntimeParams["search_path"]))

	for i := 1; i <= 2; i++ {
		if err := run(300); err != nil {
			t.Fatalf("run %d: %v", i, err)
		}
	}
	var note string
	if err := pool.QueryRow(ctx, `SELECT note FROM outbox`).Scan(&note); err != nil || note != "a service's own" {
		t.Fatalf("the service's table beside the demo's: %q, %v", note, err)
	}
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
