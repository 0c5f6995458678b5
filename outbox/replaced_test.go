package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// The leader lock is keyed by the table's oid, looked up when a relay's
// session begins. A table dropped and made again (a migration down and up,
// a restore) while relays ran got a new oid: the leader went on publishing
// it by name under the old table's lock, and a relay whose session began
// afterwards took the new table's lock, so that both led and published
// the same rows, each key's order lost between them. A leader finds its
// table replaced at its next read that finds nothing, and leads again
// only once it holds the new table's lock.
func TestReplacedTableHasOneLeader(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	ctx := context.Background()
	cfg := outbox.RelayConfig{PollInterval: 20 * time.Millisecond,
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}}
	first, _ := startRelay(t, pool, k.publisher(t), cfg)
	require.Eventually(t, first.Leader, 10*time.Second, 5*time.Millisecond)

	var oldOID, newOID uint32
	require.NoError(t, pool.QueryRow(ctx, `SELECT 'outbox'::regclass::oid`).Scan(&oldOID))
	s, err := outbox.New(outbox.Config{})
	require.NoError(t, err)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `DROP TABLE outbox`)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, s.SchemaSQL())
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))

	require.NoError(t, pool.QueryRow(ctx, `SELECT 'outbox'::regclass::oid`).Scan(&newOID))

	second, _ := startRelay(t, pool, k.publisher(t), cfg)
	// The leader locks held: the old table's released, the new table's
	// taken by one relay.
	held := func(oid uint32) (n int) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted
	AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) AND classid = $1 AND objid = $2`,
			uint32(0x6f626f78), oid).Scan(&n))
		return n
	}
	require.Eventually(t, func() bool { return held(oldOID) == 0 && held(newOID) == 1 }, 10*time.Second, 5*time.Millisecond,
		"the old table's lock released, the new one's held")
	require.Eventually(t, func() bool { return first.Leader() != second.Leader() }, 10*time.Second, 5*time.Millisecond,
		"one relay leads the new table")
	// And it stays so: the one that does not lead waits for the new
	// table's lock.
	for range 50 {
		assert.False(t, first.Leader() && second.Leader(), "two leaders")
		time.Sleep(10 * time.Millisecond)
	}
	d := k.destination(t)
	addCommitted(t, pool, d.msg("k", "after"))
	waitRows(t, pool, "true", 0, 10*time.Second)
	assert.Equal(t, []string{"after"}, bodies(d.read(t, 1)))
}
