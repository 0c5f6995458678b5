package dedup

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

var update = flag.Bool("update", false, "rewrite migrations/ from the embedded templates")

// The plain SQL files for goose (migrations/NNN_name.sql, both directions
// in one file) and golang-migrate (migrations/golang-migrate/) are the
// embedded migrations rendered with the default names. Regenerate them
// with: go test ./dedup -run TestMigrationFilesMatchEmbedded -update
func TestMigrationFilesMatchEmbedded(t *testing.T) {
	s, err := New(Config{})
	require.NoError(t, err)
	want := map[string]string{}
	for _, m := range s.series.Migrations {
		base := fmt.Sprintf("%03d_%s", m.Version, m.Name)
		want[base+".sql"] = "-- +goose Up\n" + m.Up + "\n-- +goose Down\n" + m.Down
		want[filepath.Join("golang-migrate", base+".up.sql")] = m.Up
		want[filepath.Join("golang-migrate", base+".down.sql")] = m.Down
	}
	for name, text := range want {
		path := filepath.Join("migrations", name)
		if *update {
			require.NoError(t, os.WriteFile(path, []byte(text), 0o644))
			continue
		}
		file, err := os.ReadFile(path)
		require.NoError(t, err, "regenerate with -update")
		assert.Equal(t, text, string(file), "%s differs from the embedded migration; regenerate with -update", path)
	}
	for _, glob := range []string{"migrations/*.sql", "migrations/golang-migrate/*.sql"} {
		files, err := filepath.Glob(glob)
		require.NoError(t, err)
		for _, f := range files {
			rel, _ := filepath.Rel("migrations", f)
			assert.Contains(t, want, rel, "%s is not an embedded migration", f)
		}
	}
}

// Every step of this release is marked additive (each only adds what the
// code before it does not read or can leave out), so a release of any
// earlier version runs on tables this one migrated: a deploy rolled back
// starts, its check of the tables passing, the tables unchanged.
func TestEveryEarlierReleaseRunsOnThisSchema(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	s, err := New(Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	for upTo := 1; upTo < SchemaVersion; upTo++ {
		older, err := New(Config{})
		require.NoError(t, err)
		older.series.Migrations = older.series.Migrations[:upTo]
		require.NoError(t, older.Migrate(ctx, pool), "a release of schema version %d", upTo)
		v, err := older.Version(ctx, pool)
		require.NoError(t, err)
		assert.Equal(t, SchemaVersion, v, "unchanged")
	}
}
