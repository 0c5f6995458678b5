package outbox

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// Schema versions 2 to 4 only add (a column with a default, indexes,
// triggers, a function replaced), so a release of version 1 runs on a table this one migrated: a deploy
// rolled back starts, its check of the table passing, the table unchanged.
// And a table of version 1 with a row waiting behind a parked one is
// brought to version 2 with the row ready, to be marked by the relay.
func TestAReleaseOfSchemaVersionOneRunsOnThisSchema(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	older, err := New(Config{})
	require.NoError(t, err)
	older.series.Migrations = older.series.Migrations[:1]
	// Its check wants the columns of version 1.
	older.series.Verify = func(ctx context.Context, tx pgx.Tx) error { return older.check(ctx, tx, adoptedColumns) }
	require.NoError(t, older.Migrate(ctx, pool))
	st, err := older.Status(ctx, pool)
	require.NoError(t, err, "the status of a table of version 1")
	assert.Equal(t, Status{}, st)
	current, err := New(Config{})
	require.NoError(t, err)
	err = current.Check(ctx, pool)
	require.ErrorIs(t, err, ErrSchemaMismatch, "this release's check of a table of version 1 (a relay with SkipMigrate)")
	assert.Contains(t, err.Error(), "schema version 1")
	_, err = pool.Exec(ctx, `INSERT INTO outbox (event_id, topic, key, body, attempts, parked_at) VALUES ('p', 't', 'a', 'x', 3, now());
INSERT INTO outbox (event_id, topic, key, body) VALUES ('w', 't', 'a', 'x')`)
	require.NoError(t, err)

	s, err := New(Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	require.NoError(t, older.Migrate(ctx, pool), "a release of schema version 1 on the newest version")
	v, err := s.series.Version(ctx, pool)
	require.NoError(t, err)
	assert.Equal(t, len(s.series.Migrations), v, "unchanged")
	var waiting bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT waiting FROM outbox WHERE event_id = 'w'`).Scan(&waiting))
	assert.False(t, waiting)
}
