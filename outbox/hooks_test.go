package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
)

// A pool whose connections are set up by its AfterConnect hook (here the
// search_path, to a schema of the service's own) had them set up for Add
// and Migrate, but not for the relay's own session, which resolved the
// table's name without the hook: it led and published another schema's
// outbox, of the search_path the connection string gives, deleting its
// rows, and never the rows of its own. The relay's session is made like
// the pool's connections now: BeforeConnect and AfterConnect run for it.
func TestRelaySessionRunsThePoolsConnectHooks(t *testing.T) {
	ctx := context.Background()
	k := newKafka(t)
	theirs, _ := migrated(t) // the schema of the connection string's search_path
	_, mine := pgtest.Schema(t)
	cfg := theirs.Config()
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, "SET search_path TO "+pgx.Identifier{mine}.Sanitize())
		return err
	}
	cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
		cc.RuntimeParams["application_name"] = "svc-hooked"
		return nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, outbox.Migrate(ctx, pool))

	d := k.destination(t)
	addCommitted(t, theirs, d.msg("k", "theirs"))
	addCommitted(t, pool, d.msg("k", "mine"))
	r, _ := startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond})
	require.Eventually(t, r.Leader, 10*time.Second, 5*time.Millisecond)
	waitRows(t, pool, "true", 0, 10*time.Second)
	assert.Equal(t, []string{"mine"}, bodies(d.read(t, 1)))
	assert.Equal(t, 1, rows(t, theirs, "true"), "the other schema's outbox is left alone")
	var app string
	require.NoError(t, theirs.QueryRow(ctx, `SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
	AND l.classid = $1 AND l.objid = $2::regclass::oid`, uint32(0x6f626f78), mine+".outbox").Scan(&app))
	assert.Equal(t, "svc-hooked", app, "the leader's session was made with BeforeConnect")
}
