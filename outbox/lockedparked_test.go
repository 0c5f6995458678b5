package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// A parked row edited by hand in a transaction left open (the docs say to
// fix a parked row, then Requeue it; a client in manual-commit mode, or a
// Requeue inside a longer transaction) stopped the whole outbox, every key,
// for as long as the transaction lasted: the relay's read that marks rows
// waiting locks the refused row FOR SHARE, waited the session's 5 s
// lock_timeout for it, failed, and the next read (a second later, after
// the backoff) was a marking read again. A refused row holds only its own
// key back (guarantee O4): a read that cannot lock it marks nothing behind
// it this time, and the other keys go on.
func TestParkedRowLockedByAnOpenTransactionHoldsOnlyItsKey(t *testing.T) {
	publishBesideALockedRow(t, `UPDATE outbox SET headers = '{}' WHERE parked_at IS NOT NULL`)
}

// The same for a row waiting behind a parked row, not yet marked, that an
// open transaction holds (edited by hand): the read that marks it waited
// for its lock, failed at lock_timeout, and no key was published while the
// lock lasted.
func TestRowBehindAParkedRowLockedByAnOpenTransactionHoldsNoOtherKey(t *testing.T) {
	publishBesideALockedRow(t, `UPDATE outbox SET body = 'a/2 fixed' WHERE key = 'a' AND parked_at IS NULL`)
}

// publishBesideALockedRow parks a row of key a, queues another of key a
// behind it, runs edit in a transaction left open, and starts a relay:
// rows of other keys must be published at once, the row of key a held
// back.
func publishBesideALockedRow(t *testing.T, edit string) {
	ctx := context.Background()
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	_, err := pool.Exec(ctx, `INSERT INTO outbox (event_id, topic, key, body, attempts, parked_at, last_error)
VALUES ('p', $1, 'a', 'a/1', 5, now(), 'headers are not a JSON object of strings')`, d.(*kafkaDest).topic)
	require.NoError(t, err)
	addCommitted(t, pool, d.msg("a", "a/2"))
	open, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = open.Rollback(ctx) }()
	_, err = open.Exec(ctx, edit)
	require.NoError(t, err)

	startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond})
	addCommitted(t, pool, d.msg("b", "b/1"), d.msg("c", "c/1"))
	started := time.Now()
	assert.Eventually(t, func() bool { return rows(t, pool, "key <> 'a'") == 0 }, 8*time.Second, 20*time.Millisecond,
		"the other keys' rows are published while a row of key a is locked by an open transaction")
	t.Logf("other keys published after %v", time.Since(started).Round(time.Millisecond))
	require.NoError(t, open.Rollback(ctx))
	assert.ElementsMatch(t, []string{"b/1", "c/1"}, bodies(d.read(t, 2)))
	assert.Equal(t, 1, rows(t, pool, "key = 'a' AND parked_at IS NULL"), "the row of key a still waits behind the parked one")
}
