package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
)

// A session the server ended past idle_in_transaction_session_timeout
// while the relay's migration waited on the client (a busy machine between
// two statements) ended Run with 25P03, as a refusal: the relay stopped
// for a moment's stall. It is retried, as an unavailable database, and
// the relay publishes.
func TestIdleInTransactionTimeoutDuringMigrationIsRetried(t *testing.T) {
	k := newKafka(t)
	_, schema := pgtest.Schema(t)
	tracer := &pgtest.StallOnce{Stall: 300 * time.Millisecond}
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = "50ms"
		c.ConnConfig.Tracer = tracer
	})
	d := k.destination(t)
	r, err := outbox.NewRelay(pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, Logger: testLogger(),
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	deadline := time.After(30 * time.Second)
	for !r.Leader() {
		select {
		case err := <-done:
			t.Fatalf("Run returned before leading: %v", err)
		case <-deadline:
			t.Fatal("the relay did not lead within 30 s")
		case <-time.After(5 * time.Millisecond):
		}
	}
	require.True(t, tracer.Stalled(), "the migration's transaction was not held up")
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return outbox.Add(ctx, tx, d.msg("a", "a/1")) }))
	got := d.read(t, 1)
	require.Equal(t, "a/1", got[0].Body)
	cancel()
	require.NoError(t, <-done)
}
