package kafka

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// After a failover the pool's connections may reach the old primary, now
// read-only: every write they send is refused (25006). The take-over of a
// session's partitions in the offsets table retried on those connections
// for as long as the pool kept them (pgxpool's MaxConnLifetime, an hour by
// default), and no record was consumed meanwhile. It resets the pool, as
// the consumer does for its own writes, and the retry reaches a writable
// server. Here the read-only server is the pool's first backends alone,
// for writes of the offsets table, so that only the take-over meets it.
func TestTakeOverOnReadOnlyConnectionsResetsThePool(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 1)
	admin, schema := pgtest.Schema(t)
	ctx := context.Background()
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, admin))
	_, err = admin.Exec(ctx, effectsTable+`;
CREATE SEQUENCE refused_writes;
CREATE TABLE read_only_backends (pid int);
CREATE FUNCTION refuse_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM read_only_backends WHERE pid = pg_backend_pid()) THEN
        PERFORM nextval('refused_writes');
        RAISE EXCEPTION 'cannot execute INSERT in a read-only transaction' USING ERRCODE = 'read_only_sql_transaction';
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER refuse_write BEFORE INSERT OR UPDATE ON processed_events_offsets FOR EACH STATEMENT EXECUTE FUNCTION refuse_write()`)
	require.NoError(t, err)

	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.MaxConns = 2 })
	var conns []*pgxpool.Conn
	for range 2 {
		conn, err := pool.Acquire(ctx)
		require.NoError(t, err)
		conns = append(conns, conn)
		var pid int
		require.NoError(t, conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
		_, err = admin.Exec(ctx, `INSERT INTO read_only_backends VALUES ($1)`, pid)
		require.NoError(t, err)
	}
	for _, conn := range conns {
		conn.Release()
	}

	c.produceHashed(events(topic, "e", 0, 3))
	src, err := Open(t.Context(), c.dbOffsetsConfig(uniq("g"), topic))
	require.NoError(t, err)
	r := startConsumer(t, pool, src, consumerConfig("svc"), recordEffect)
	waitEffects(t, admin, 3, 20*time.Second)
	require.NoError(t, r.stop())
	requireExactlyOnce(t, admin, "e", 3)
	var refused int64
	require.NoError(t, admin.QueryRow(ctx, `SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM refused_writes`).Scan(&refused))
	assert.Positive(t, refused, "the take-over met the read-only connections")
}
