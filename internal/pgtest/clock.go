package pgtest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// SkewedClock creates, beside schema, a schema holding a now() that
// returns the server's clock plus skew, and returns a pool whose sessions
// find it first (search_path: that schema, schema, pg_catalog). To those
// sessions the database's clock reads skew ahead of the test's (behind,
// for a negative skew): what a database host whose clock drifted from the
// application's gives, for tests of code that must take its time from the
// database. It returns the search_path too, for a URL's search_path
// parameter. Column defaults bound to now() before are not affected. The
// schema and the pool are removed when the test ends.
func SkewedClock(t testing.TB, schema string, skew time.Duration) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := context.Background()
	clock := schema + "_clock"
	admin := NewPool(t, schema)
	stmt := fmt.Sprintf(`CREATE SCHEMA %[1]s;
CREATE FUNCTION %[1]s.now() RETURNS timestamptz LANGUAGE sql STABLE
	AS $$ SELECT pg_catalog.now() + %[2]d * interval '1 microsecond' $$`, clock, skew.Microseconds())
	if _, err := admin.Exec(ctx, stmt); err != nil {
		t.Fatalf("pgtest: skewed clock: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
		defer cancel()
		_, _ = admin.Exec(ctx, "DROP SCHEMA "+clock+" CASCADE")
	})
	path := clock + "," + schema + ",pg_catalog"
	return NewPoolWith(t, schema, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.RuntimeParams["search_path"] = path
	}), path
}
