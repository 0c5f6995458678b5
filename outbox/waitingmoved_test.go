package outbox

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// Rows the relay marked waiting behind a refused row of their key leave
// the index its reads walk, and the refused row gives them back when it
// stops holding their key back (the release triggers). A refused row
// whose topic or key was changed by hand (a typo in a parked row's topic
// fixed, then requeued, as docs/outbox.md invites) still held its old key
// back by the triggers' reckoning: they fired only when the row stopped
// being refused, and then released the rows of its new topic and key.
// The rows waiting behind its old ones stayed waiting for ever, never
// read, never published, never parked. Moving a refused row releases the
// rows of the topic and key it leaves.
func TestRefusedRowMovedToAnotherKeyReleasesTheRowsOfItsOldKey(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	s, err := New(Config{})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, pool))
	var parked int64
	require.NoError(t, pool.QueryRow(ctx, `INSERT INTO outbox (event_id, topic, key, body, attempts, parked_at, last_error)
VALUES ('p', 'ordrs', 'a', 'x', 5, now(), 'unknown topic') RETURNING seq`).Scan(&parked))
	_, err = pool.Exec(ctx, `INSERT INTO outbox (event_id, topic, key, body, waiting) VALUES
	('w1', 'ordrs', 'a', 'x', true), ('w2', 'ordrs', 'a', 'x', true), ('other', 'orders', 'b', 'x', true)`)
	require.NoError(t, err)

	waiting := func() []string {
		rows, err := pool.Query(ctx, `SELECT event_id FROM outbox WHERE waiting ORDER BY seq`)
		require.NoError(t, err)
		var ids []string
		for rows.Next() {
			var id string
			require.NoError(t, rows.Scan(&id))
			ids = append(ids, id)
		}
		require.NoError(t, rows.Err())
		return ids
	}
	_, err = pool.Exec(ctx, `UPDATE outbox SET last_error = 'still refused' WHERE seq = $1`, parked)
	require.NoError(t, err)
	assert.Equal(t, []string{"w1", "w2", "other"}, waiting(), "a refused row changed in place holds its key back still")

	_, err = pool.Exec(ctx, `UPDATE outbox SET topic = 'orders' WHERE seq = $1`, parked)
	require.NoError(t, err)
	assert.Equal(t, []string{"other"}, waiting(), "the rows of the topic and key the refused row left are given back")

	// Marked again (as by an older release's relay, say).
	_, err = pool.Exec(ctx, `UPDATE outbox SET waiting = true WHERE event_id IN ('w1', 'w2')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE outbox SET key = 'b' WHERE seq = $1`, parked)
	require.NoError(t, err)
	assert.Equal(t, []string{"w1", "w2", "other"}, waiting(), "moved from a key no row waits for: nothing to give back")
	_, err = pool.Exec(ctx, `UPDATE outbox SET key = 'c' WHERE seq = $1`, parked)
	require.NoError(t, err)
	assert.Equal(t, []string{"w1", "w2"}, waiting(),
		"moved to another key: the rows of the key it left (b) are given back, not those of another topic")
}
