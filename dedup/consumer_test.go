package dedup_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// The consumer's start-up meets a processed_events table of another shape:
// Run returns at once with an error naming what differs, whether it
// migrates or, under SkipMigrate, only checks. (Before, every claim failed
// with 42703, was taken for infrastructure and retried forever.)
func TestConsumerStartFailsOnAnotherShape(t *testing.T) {
	t.Parallel()
	for _, skip := range []bool{false, true} {
		t.Run(fmt.Sprintf("SkipMigrate=%v", skip), func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			pool, _ := pgtest.Schema(t)
			_, err := pool.Exec(ctx, `CREATE TABLE processed_events (id bigserial PRIMARY KEY, message_id uuid NOT NULL, handled_at timestamptz)`)
			require.NoError(t, err)
			broker := memsource.New(memsource.Options{})
			broker.Publish(consumer.Message{ID: "e1", Value: []byte(`{}`)})
			handle := func(context.Context, pgx.Tx, consumer.Event[anyPayload]) error { return nil }
			c, err := consumer.New(pool, broker.Source(), handle, consumer.Config{Name: "billing", SkipMigrate: skip})
			require.NoError(t, err)

			runCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			err = c.Run(runCtx)
			require.ErrorIs(t, err, dedup.ErrSchemaMismatch, "Run must fail at start, not wait")
			assert.Contains(t, err.Error(), "column event_id (text) is missing")
			assert.Contains(t, err.Error(), "column message_id is NOT NULL without a default")
			assert.Equal(t, 0, broker.Acked(), "nothing is handled")
		})
	}
}

// anyPayload decodes any JSON object.
type anyPayload = map[string]any

// Two services share the table; one runs with a one-hour retention. Its
// retention removes its own old rows and leaves the other service's, of
// the same age, where they are.
func TestConsumerRetentionIsPerConsumer(t *testing.T) {
	t.Parallel()
	ctx, pool, s := setup(t)
	for _, name := range []string{"billing", "shipping"} {
		for i := range 3 {
			claimTx(t, ctx, pool, s, dedup.Claim{Consumer: name, EventID: fmt.Sprintf("old-%d", i)})
		}
	}
	_, err := pool.Exec(ctx, `UPDATE processed_events SET processed_at = now() - interval '2 days'`)
	require.NoError(t, err)

	broker := memsource.New(memsource.Options{})
	handle := func(context.Context, pgx.Tx, consumer.Event[anyPayload]) error { return nil }
	c, err := consumer.New(pool, broker.Source(), handle, consumer.Config{
		Name: "billing", Store: s, Retention: consumer.RetentionConfig{MaxAge: time.Hour, Interval: 10 * time.Millisecond},
	})
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()

	count := func(name string) int {
		return rowCount(t, ctx, pool, `SELECT count(*) FROM processed_events WHERE consumer = $1`, name)
	}
	require.Eventually(t, func() bool { return count("billing") == 0 }, 30*time.Second, 10*time.Millisecond,
		"billing's retention removes billing's old rows")
	// A retention for every consumer would have removed shipping's rows in
	// the same statements as billing's.
	assert.Equal(t, 3, count("shipping"), "billing's retention must not end shipping's deduplication")
}
