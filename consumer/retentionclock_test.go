package consumer_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// Retention's window is measured by the database's clock, which wrote
// processed_at, not by the consumer host's: with the database's clock two
// hours behind the host's, a window of three hours deleted rows two hours
// old by the database (the host's cutoff was then one hour before the
// database's now), and a redelivery of such an event was handled again.
// Now only rows older than the window by the database's clock go, and the
// redelivery is skipped.
func TestRetentionWindowIsMeasuredByTheDatabaseClock(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	store := migratedStore(t, pool)
	skewed, _ := pgtest.SkewedClock(t, schema, -2*time.Hour)

	// processed_at as the database wrote it: two hours old (within the
	// window) and four hours old (past it), by the database's clock.
	for id, age := range map[string]string{"within": "2 hours", "expired": "4 hours"} {
		require.NoError(t, pgx.BeginFunc(ctx, skewed, func(tx pgx.Tx) error {
			if _, err := store.Claim(ctx, tx, dedup.Claim{Consumer: "clock", EventID: id, Partition: -1, Offset: -1}); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `UPDATE processed_events SET processed_at = now() - $2::interval
				WHERE consumer = 'clock' AND event_id = $1`, id, age)
			return err
		}))
	}

	cfg := fastConfig("clock")
	cfg.Retention = consumer.RetentionConfig{MaxAge: 3 * time.Hour, Interval: 10 * time.Millisecond}
	b := memsource.New(memsource.Options{Streams: 1})
	c, err := consumer.New(skewed, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	defer stop() //nolint:errcheck

	processed := func(id string) bool {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE consumer = 'clock' AND event_id = $1`, id).Scan(&n))
		return n == 1
	}
	require.Eventually(t, func() bool { return !processed("expired") }, 10*time.Second, 10*time.Millisecond,
		"retention removes the row past the window")
	require.True(t, processed("within"), "a row inside the window by the database's clock was deleted")

	v, _ := json.Marshal(order{N: 1})
	b.Publish(consumer.Message{Value: v, Headers: map[string]string{"id": "within"}, Redelivered: true})
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, time.Millisecond)
	require.Empty(t, countEffects(t, pool), "the redelivery of an event inside the window was handled again")
	require.EqualValues(t, 1, c.Stats().Duplicates)
}

// migratedStore makes the effects table and the default store's tables on
// pool, and returns the store.
func migratedStore(t *testing.T, pool *pgxpool.Pool) *dedup.Store {
	t.Helper()
	effects(t, pool)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background(), pool))
	return store
}
