package consumer_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// A suspect's crash-guard record is deleted in its handler's transaction,
// and stays locked while the handler runs. Retention, meeting that record
// once it is older than Retention.MaxAge, passes over it: it goes on
// deleting the other expired records instead of waiting for the handler.
func TestRetentionDoesNotWaitForARunningSuspect(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	ctx := context.Background()
	cfg := fastConfig("guard-retention")
	cfg.Retention = consumer.RetentionConfig{MaxAge: time.Second, Interval: 10 * time.Millisecond}
	b := memsource.New(memsource.Options{Streams: 1})
	v, _ := json.Marshal(order{N: 1})
	// Redelivered: a suspect, with a record for the handler's
	// transaction to delete.
	b.Publish(consumer.Message{Value: v, Headers: map[string]string{"id": "held"}, Key: []byte("held"), Redelivered: true})
	entered, release := make(chan struct{}), make(chan struct{})
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		close(entered)
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	defer stop() //nolint:errcheck
	<-entered
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()

	// The record, deleted but not committed, is still there for others:
	// wait until it is past the retention window.
	require.Eventually(t, func() bool {
		var expired bool
		err := pool.QueryRow(ctx, `SELECT last_seen < now() - interval '2 seconds' FROM processed_events_attempts
			WHERE consumer = 'guard-retention' AND event_id = 'held'`).Scan(&expired)
		return err == nil && expired
	}, 30*time.Second, 10*time.Millisecond, "the running suspect has no record")

	_, err = pool.Exec(ctx, `INSERT INTO processed_events_attempts (consumer, event_id, attempts, crashes, last_seen)
		VALUES ('guard-retention', 'free', 1, 1, now() - interval '1 hour')`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM processed_events_attempts
			WHERE consumer = 'guard-retention' AND event_id = 'free'`).Scan(&n)
		return err == nil && n == 0
	}, 10*time.Second, 10*time.Millisecond, "retention stopped at the running suspect's record")

	close(release)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, time.Millisecond)
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_events_attempts WHERE consumer = 'guard-retention'`).Scan(&n))
	require.Zero(t, n, "the record went with the handler's effects")
}
