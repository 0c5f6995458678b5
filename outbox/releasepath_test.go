package outbox

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// The release triggers of a table migrated with Schema "" (the table found
// through the service's search_path) named the table unqualified in their
// function, which PostgreSQL resolves through the search_path of whichever
// session fires them. A parked row requeued from a session with another
// search_path (a DBA's UPDATE in psql naming the schema; Store.Requeue
// with Config.Schema set, on a pool of another search_path) failed with
// "relation does not exist", or, with another outbox of the name on that
// path, gave back that table's rows instead, and its own stayed waiting
// until the relay's next marking read. The triggers update the table that fired
// them.
func TestReleaseTriggerUpdatesItsOwnTableWhateverTheSearchPath(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	s, err := New(Config{}) // the service's: on its search_path
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	var parked int64
	require.NoError(t, pool.QueryRow(ctx, `INSERT INTO outbox (event_id, topic, key, body, attempts, parked_at, last_error)
VALUES ('p', 'orders', 'a', 'x', 5, now(), 'refused') RETURNING seq`).Scan(&parked))
	_, err = pool.Exec(ctx, `INSERT INTO outbox (event_id, topic, key, body, waiting) VALUES ('w', 'orders', 'a', 'x', true)`)
	require.NoError(t, err)

	// An operator's session, on another search_path where another
	// service's outbox of the same name is, requeues the row in plain SQL
	// naming the schema (docs/outbox.md: the triggers give the rows back
	// whoever ends the refusal).
	adminPool, _ := pgtest.Schema(t)
	require.NoError(t, s.Migrate(ctx, adminPool))
	_, err = adminPool.Exec(ctx, `INSERT INTO outbox (event_id, topic, key, body, waiting) VALUES ('theirs', 'orders', 'a', 'x', true)`)
	require.NoError(t, err)

	tag, err := adminPool.Exec(ctx, `UPDATE `+pgx.Identifier{schema, "outbox"}.Sanitize()+` SET parked_at = NULL, attempts = 0 WHERE seq = $1`, parked)
	require.NoError(t, err)
	assert.Equal(t, int64(1), tag.RowsAffected())
	var waiting bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT waiting FROM outbox WHERE event_id = 'w'`).Scan(&waiting))
	assert.False(t, waiting, "the row waiting behind the requeued one is given back")
	require.NoError(t, adminPool.QueryRow(ctx, `SELECT waiting FROM outbox WHERE event_id = 'theirs'`).Scan(&waiting))
	assert.True(t, waiting, "another table's rows are left alone")
}

// Version 4 replaces the release function; with Schema "" the new one is
// created in the first schema of the search_path, which need not be the
// one version 2 made the function in (the path changed since). The
// triggers are made again on it, so that they do not call the old one.
func TestReleaseFunctionReplacedUnderAnotherSearchPathIsTheOneCalled(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	older, err := New(Config{})
	require.NoError(t, err)
	older.series.Migrations = older.series.Migrations[:3]
	older.series.Verify = nil
	require.NoError(t, older.Migrate(ctx, pool))

	// The service's search_path now has a schema of its own first.
	_, first := pgtest.Schema(t)
	moved := pgtest.NewPool(t, first+", "+schema)
	s, err := New(Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, moved))

	var parked int64
	require.NoError(t, pool.QueryRow(ctx, `INSERT INTO outbox (event_id, topic, key, body, attempts, parked_at, last_error)
VALUES ('p', 'orders', 'a', 'x', 5, now(), 'refused') RETURNING seq`).Scan(&parked))
	_, err = pool.Exec(ctx, `INSERT INTO outbox (event_id, topic, key, body, waiting) VALUES ('w', 'orders', 'a', 'x', true)`)
	require.NoError(t, err)
	// Requeued from a session that does not find the table by its path.
	other, _ := pgtest.Schema(t)
	_, err = other.Exec(ctx, `UPDATE `+pgx.Identifier{schema, "outbox"}.Sanitize()+` SET parked_at = NULL, attempts = 0 WHERE seq = $1`, parked)
	require.NoError(t, err)
	var waiting bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT waiting FROM outbox WHERE event_id = 'w'`).Scan(&waiting))
	assert.False(t, waiting, "the row waiting behind the requeued one is given back")
}
