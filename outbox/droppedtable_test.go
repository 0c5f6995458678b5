package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// An outbox table dropped by hand after Migrate recorded its version (to
// empty it, or by applying outbox/migrations/001_outbox.down.sql, which
// docs/outbox.md says drops it all) failed every later Migrate, so every
// relay's start, with "does not exist: run Store.Migrate": the version
// recorded, Migrate had nothing to run, and only an edit of
// once_schema_versions by hand got out. Migrate makes the table again, as
// dedup's does its own: the relay starts, and publishes what is added.
func TestTableDroppedAfterItsVersionWasRecordedIsMadeAgain(t *testing.T) {
	pool, _ := migrated(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `DROP TABLE outbox`)
	require.NoError(t, err)
	require.NoError(t, outbox.Migrate(ctx, pool), "Migrate makes the dropped table again")

	pub := &confirmingPublisher{ids: map[string]int{}}
	r, _ := startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, Logger: testLogger()})
	require.Eventually(t, r.Leader, 20*time.Second, 5*time.Millisecond, "the relay starts on the table made again")
	addCommitted(t, pool, outbox.Message{ID: "after-the-drop", Topic: "t", Key: []byte("k"), Body: []byte("x")})
	waitRows(t, pool, "true", 0, 30*time.Second)
	assert.Equal(t, map[string]int{"after-the-drop": 1}, pub.published())
}
