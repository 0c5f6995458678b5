package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// After a failover the leader's session can stay connected to the old
// primary, now a standby: every write it sends is refused as read-only
// (25006) while its reads still work. The relay wrote the delete of the
// batch it had published again and again on that session, for as long as
// the session lived, and nothing of the outbox moved. The leader's server
// turning read-only ends the session; the next one (a connection made
// anew, to the server the connection string names now) writes the
// settlement first, so the batch is deleted and not published again.
// Here the read-only server is the leader session's backend alone.
func TestLeaderOnAServerTurnedReadOnlyReconnects(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE SEQUENCE refused_deletes;
CREATE TABLE read_only_backends (pid int);
CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM read_only_backends WHERE pid = pg_backend_pid()) THEN
        PERFORM nextval('refused_deletes');
        RAISE EXCEPTION 'cannot execute DELETE in a read-only transaction' USING ERRCODE = 'read_only_sql_transaction';
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER refuse_delete BEFORE DELETE ON outbox FOR EACH STATEMENT EXECUTE FUNCTION refuse_delete()`)
	require.NoError(t, err)

	r, _ := startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond,
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 20 * time.Millisecond}})
	require.Eventually(t, r.Leader, 10*time.Second, 5*time.Millisecond)
	var pid int
	require.NoError(t, pool.QueryRow(ctx, `SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted
	AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) AND classid = $1 AND objid = 'outbox'::regclass::oid`,
		uint32(0x6f626f78)).Scan(&pid))
	_, err = pool.Exec(ctx, `INSERT INTO read_only_backends VALUES ($1)`, pid)
	require.NoError(t, err)

	const n = 5
	var msgs []outbox.Message
	for i := range n {
		msgs = append(msgs, d.msg("k", fmt.Sprint("m", i)))
	}
	addCommitted(t, pool, msgs...)
	waitRows(t, pool, "true", 0, 30*time.Second)
	var refused int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM refused_deletes`).Scan(&refused))
	assert.Positive(t, refused, "the leader's session was refused the delete")
	got := d.read(t, n)
	assert.Equal(t, []string{"m0", "m1", "m2", "m3", "m4"}, bodies(got), "each row published once, in order")
}
