package idempotency_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtemp"
	"github.com/onceco/once/internal/pgtest"
)

// keysDDL is the table as the migration makes it, with placeholders for
// the scope and key columns' collation and for what follows the key.
const keysDDL = `CREATE TABLE idempotency_keys (
    scope           text        NOT NULL,
    idempotency_key text        NOT NULL,
    fingerprint     bytea,
    method          text        NOT NULL DEFAULT '',
    path            text        NOT NULL DEFAULT '',
    status          integer     NOT NULL DEFAULT 0,
    header          jsonb       NOT NULL DEFAULT '{}',
    body            bytea       NOT NULL DEFAULT '',
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (scope, idempotency_key)
)`

// ciCollation creates a case-insensitive collation, ci, or skips the test.
func ciCollation(t *testing.T, ctx context.Context, exec func(context.Context, string) error) {
	t.Helper()
	if err := exec(ctx, `CREATE COLLATION ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)`); err != nil {
		t.Skipf("no ICU collations on this server: %v", err)
	}
}

// A table of the name made by hand whose scope compares case-insensitively
// (a citext-like collation, common for user names) was adopted by Migrate
// as it was: its primary key took the scopes "Alice" and "alice" for one,
// and a client got another client's stored response for its key. Migrate
// refuses such a table now, naming the column.
func TestMigrateRefusesATableThatMixesScopes(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	ctx := context.Background()
	exec := func(ctx context.Context, sql string) error { _, err := pool.Exec(ctx, sql); return err }
	ciCollation(t, ctx, exec)
	require.NoError(t, exec(ctx, `CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, body text NOT NULL)`))
	require.NoError(t, exec(ctx, `CREATE TABLE idempotency_keys (
    scope           text COLLATE ci NOT NULL,
    idempotency_key text        NOT NULL,
    fingerprint     bytea,
    method          text        NOT NULL DEFAULT '',
    path            text        NOT NULL DEFAULT '',
    status          integer     NOT NULL DEFAULT 0,
    header          jsonb       NOT NULL DEFAULT '{}',
    body            bytea       NOT NULL DEFAULT '',
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (scope, idempotency_key)
)`))
	err := idempotency.Migrate(ctx, pool, schema)
	if err == nil {
		// What the adopted table does.
		scope := func(r *http.Request) string { return r.Header.Get("X-Client") }
		s := serve(t, pool, schema, idempotency.Config{Scope: scope}, http.HandlerFunc(insertEffect))
		first := s.post("/orders", "k", "b", "X-Client", "Alice")
		require.Equal(t, http.StatusCreated, first.status, first.body)
		other := s.post("/orders", "k", "b", "X-Client", "alice")
		assert.False(t, other.replayed(), "the client alice got Alice's response %s", other.body)
		t.Fatal("Migrate adopted a table whose scope column compares case-insensitively")
	}
	require.ErrorIs(t, err, idempotency.ErrSchemaMismatch)
	assert.Contains(t, err.Error(), "column scope has a nondeterministic collation")
}

// Migrate names what is wrong with a table of the name that the claim
// cannot rely on, and takes one that differs only in ways the middleware
// does not see.
func TestMigrateChecksTheTablesShape(t *testing.T) {
	for _, tc := range []struct {
		name, ddl string
		diffs     []string // nil: accepted
	}{{
		name:  "case-insensitive keys",
		ddl:   strings.Replace(keysDDL, "idempotency_key text", "idempotency_key text COLLATE ci", 1),
		diffs: []string{"column idempotency_key has a nondeterministic collation"},
	}, {
		name: "key index under a folding collation",
		ddl: strings.Replace(keysDDL, ",\n    PRIMARY KEY (scope, idempotency_key)", "", 1) +
			`; CREATE UNIQUE INDEX keys_ci ON idempotency_keys (scope, idempotency_key COLLATE ci)`,
		diffs: []string{"no primary key or unique index on (scope, idempotency_key)", "unique index keys_ci takes distinct"},
	}, {
		name:  "keys unique across scopes",
		ddl:   keysDDL + `; CREATE UNIQUE INDEX keys_global ON idempotency_keys (idempotency_key)`,
		diffs: []string{"unique index keys_global takes distinct"},
	}, {
		name:  "deferrable key",
		ddl:   strings.Replace(keysDDL, "PRIMARY KEY (scope, idempotency_key)", "PRIMARY KEY (scope, idempotency_key) DEFERRABLE", 1),
		diffs: []string{"no primary key or unique index", "unique index idempotency_keys_pkey is deferrable"},
	}, {
		name: "another library's table",
		ddl:  `CREATE TABLE idempotency_keys (key text PRIMARY KEY, response jsonb NOT NULL)`,
		diffs: []string{"column scope (text) is missing", "column expires_at (timestamp with time zone) is missing",
			"column response is NOT NULL without a default", "no primary key or unique index"},
	}, {
		name:  "status without a default",
		ddl:   strings.Replace(keysDDL, "status          integer     NOT NULL DEFAULT 0", "status integer", 1),
		diffs: []string{"column status has no default"},
	}, {
		name:  "other types",
		ddl:   strings.Replace(keysDDL, "expires_at      timestamptz", "expires_at timestamp", 1),
		diffs: []string{"column expires_at is timestamp without time zone, want timestamp with time zone"},
	}, {
		name: "an unlogged partition",
		ddl: keysDDL + ` PARTITION BY LIST (scope);
CREATE TABLE idempotency_keys_a PARTITION OF idempotency_keys FOR VALUES IN ('a');
CREATE UNLOGGED TABLE idempotency_keys_rest PARTITION OF idempotency_keys DEFAULT`,
		diffs: []string{"idempotency_keys_rest is unlogged"},
	}, {
		name: "columns and keys of the user's own",
		ddl: strings.Replace(keysDDL, "expires_at      timestamptz NOT NULL,", "expires_at timestamptz NOT NULL, id bigserial UNIQUE, tenant text, note text COLLATE ci,", 1) +
			`; CREATE UNIQUE INDEX keys_tenant ON idempotency_keys (scope, idempotency_key, tenant)`,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			pool, schema := pgtest.Schema(t)
			ctx := context.Background()
			exec := func(ctx context.Context, sql string) error { _, err := pool.Exec(ctx, sql); return err }
			ciCollation(t, ctx, exec)
			require.NoError(t, exec(ctx, tc.ddl))
			err := idempotency.Migrate(ctx, pool, schema)
			if tc.diffs == nil {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, idempotency.ErrSchemaMismatch)
			for _, d := range tc.diffs {
				assert.Contains(t, err.Error(), d)
			}
			assert.Zero(t, count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'once_schema_versions'`, schema),
				"nothing recorded")
		})
	}
}

// An unlogged table of the name (made so to spare WAL: "it only holds
// keys") was adopted as it was. PostgreSQL empties an unlogged table when
// it recovers from a crash (and a standby has none of its rows): every
// stored key was forgotten, and the retry of a request that had committed
// its effect ran it again. Migrate refuses such a table now.
func TestMigrateRefusesAnUnloggedTable(t *testing.T) {
	ctx := context.Background()
	// Durable: what a commit was answered for survives the crash.
	srv, err := pgtemp.Start(ctx, pgtemp.Options{Durable: true})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })
	pool, err := pgxpool.New(ctx, srv.URL())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, err = pool.Exec(ctx, strings.Replace(keysDDL, "CREATE TABLE", "CREATE UNLOGGED TABLE", 1)+
		`; CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, body text NOT NULL)`)
	require.NoError(t, err)

	err = idempotency.Migrate(ctx, pool, "")
	if err == nil {
		// What the adopted table does.
		s := serve(t, pool, "", idempotency.Config{}, http.HandlerFunc(insertEffect))
		first := s.post("/orders", "k", "b")
		require.Equal(t, http.StatusCreated, first.status, first.body)
		pool.Close()
		require.NoError(t, srv.Crash(ctx))
		require.NoError(t, srv.Restart(ctx))
		after, err := pgxpool.New(ctx, srv.URL())
		require.NoError(t, err)
		t.Cleanup(after.Close)
		s = serve(t, after, "", idempotency.Config{}, http.HandlerFunc(insertEffect))
		again := s.post("/orders", "k", "b")
		assert.True(t, again.replayed(), "the retry after the crash ran again: %d %s", again.status, again.body)
		assert.Equal(t, 1, count(t, after, `SELECT count(*) FROM effects`), "the effects")
		t.Fatal("Migrate adopted an unlogged table")
	}
	require.ErrorIs(t, err, idempotency.ErrSchemaMismatch)
	assert.Contains(t, err.Error(), "is unlogged")
}
