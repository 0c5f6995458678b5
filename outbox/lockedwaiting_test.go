package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// The same for a row waiting behind a parked row, not yet marked, that an
// open transaction holds (edited by hand): the read that marks it waited
// for its lock, failed at lock_timeout, and no key was published while the
// lock lasted.
func TestRowBehindAParkedRowLockedByAnOpenTransactionHoldsNoOtherKey(t *testing.T) {
	ctx := context.Background()
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	topic := d.(*kafkaDest).topic

	_, err := pool.Exec(ctx, `INSERT INTO outbox (event_id, topic, key, body, attempts, parked_at, last_error)
VALUES ('p', $1, 'a', 'a/1', 5, now(), 'refused')`, topic)
	require.NoError(t, err)
	addCommitted(t, pool, d.msg("a", "a/2"))
	edit, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = edit.Rollback(ctx) }()
	_, err = edit.Exec(ctx, `UPDATE outbox SET body = 'a/2 fixed' WHERE key = 'a' AND parked_at IS NULL`)
	require.NoError(t, err)

	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond})
	addCommitted(t, pool, d.msg("b", "b/1"), d.msg("c", "c/1"))
	started := time.Now()
	assert.Eventually(t, func() bool { return rows(t, pool, "key <> 'a'") == 0 }, 8*time.Second, 20*time.Millisecond,
		"the other keys' rows are published while a row waiting behind a parked one is locked by an open transaction")
	t.Logf("other keys published after %v", time.Since(started).Round(time.Millisecond))
	require.NoError(t, edit.Rollback(ctx))
	assert.ElementsMatch(t, []string{"b/1", "c/1"}, bodies(d.read(t, 2)))
}
