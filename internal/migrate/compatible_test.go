package migrate_test

import (
	"context"
	"testing"
	"testing/fstest"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/migrate"
	"github.com/onceco/once/internal/pgtest"
)

// gadgets: version 2 adds a nullable column and says so; version 3 makes a
// column NOT NULL without a default, which code of version 2 cannot write.
var gadgets = fstest.MapFS{
	"001_gadgets.up.sql":     {Data: []byte(`CREATE TABLE g (id int PRIMARY KEY);`)},
	"001_gadgets.down.sql":   {Data: []byte(`DROP TABLE g;`)},
	"002_add_note.up.sql":    {Data: []byte("-- a nullable column: code of version 1 runs on it.\n-- once:additive\nALTER TABLE g ADD COLUMN note text;")},
	"002_add_note.down.sql":  {Data: []byte(`ALTER TABLE g DROP COLUMN note;`)},
	"003_need_kind.up.sql":   {Data: []byte(`ALTER TABLE g ADD COLUMN kind text NOT NULL;`)},
	"003_need_kind.down.sql": {Data: []byte(`ALTER TABLE g DROP COLUMN kind;`)},
}

func gadgetSeries(t *testing.T, upTo int) *migrate.Series {
	t.Helper()
	migs, err := migrate.Load(gadgets, nil)
	require.NoError(t, err)
	return &migrate.Series{Component: "gadgets", Migrations: migs[:upTo]}
}

// A deploy rolled back: the older release finds the database at a version
// the newer one made. When every step above its own is additive (recorded
// by the release that ran them), it runs on it, verified and unchanged;
// when one is not, it is refused as before, the error naming the version
// its code needs.
func TestOlderCodeRunsOnANewerAdditiveSchema(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)

	require.NoError(t, gadgetSeries(t, 2).Migrate(ctx, pool))
	older := gadgetSeries(t, 1)
	verified := 0
	older.Verify = func(ctx context.Context, tx pgx.Tx) error { verified++; return nil }
	require.NoError(t, older.Migrate(ctx, pool), "version 2 only adds: version 1 runs on it")
	assert.Equal(t, 1, verified, "the older code's check of the tables still runs")
	assert.Equal(t, []string{"id", "note"}, columns(t, ctx, pool, "g"), "unchanged")
	v, err := older.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, 2, v)
	require.ErrorIs(t, older.MigrateTo(ctx, pool, 0), migrate.ErrNewer, "no down migrations from a version it does not know")

	require.NoError(t, gadgetSeries(t, 3).Migrate(ctx, pool))
	for _, upTo := range []int{1, 2} {
		err := gadgetSeries(t, upTo).Migrate(ctx, pool)
		require.ErrorIs(t, err, migrate.ErrNewer, "code of version %d on version 3", upTo)
		assert.Contains(t, err.Error(), "needs code of version 3 or later")
	}
	assert.Equal(t, []string{"id", "note", "kind"}, columns(t, ctx, pool, "g"), "unchanged")
}

// A version table made by a release that recorded no compatibility: the
// next recorded step adds the column; until then a newer version is
// refused, as that release would have.
func TestVersionTableWithoutCompatibilityIsUpgraded(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(ctx, `CREATE TABLE once_schema_versions (
    component  text        NOT NULL,
    version    integer     NOT NULL,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (component, version));
CREATE TABLE g (id int PRIMARY KEY); ALTER TABLE g ADD COLUMN note text;
INSERT INTO once_schema_versions (component, version, name) VALUES ('gadgets', 1, 'gadgets'), ('gadgets', 2, 'add_note')`)
	require.NoError(t, err)
	require.ErrorIs(t, gadgetSeries(t, 1).Migrate(ctx, pool), migrate.ErrNewer, "nothing recorded says version 2 only adds")

	require.NoError(t, gadgetSeries(t, 3).Migrate(ctx, pool))
	var from int
	require.NoError(t, pool.QueryRow(ctx, `SELECT compatible_from FROM once_schema_versions WHERE component = 'gadgets' AND version = 3`).Scan(&from))
	assert.Equal(t, 3, from)
}

func TestLoadReadsTheAdditiveMark(t *testing.T) {
	t.Parallel()
	migs, err := migrate.Load(gadgets, nil)
	require.NoError(t, err)
	assert.Equal(t, []bool{false, true, false}, []bool{migs[0].Additive, migs[1].Additive, migs[2].Additive})
}
