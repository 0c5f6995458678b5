package consumer_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// A suspect waiting for its crash-guard lock, which another process's
// attempt of the same message holds, never started its attempt: the
// shutdown ends the wait at once, as it ends a wait for the isolation or
// between attempts, and the message is left unacked for redelivery. The
// wait went on until ShutdownTimeout (or HandlerTimeout plus twice
// DatabaseTimeout), holding Run's return all that time.
func TestShutdownEndsASuspectsWaitForItsLock(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	ctx := context.Background()
	b := memsource.New(memsource.Options{})
	v, _ := json.Marshal(order{N: 1})
	b.Publish(consumer.Message{Value: v, Headers: map[string]string{"id": "busy"}, Key: []byte("busy"), Redelivered: true})
	cfg := fastConfig("suspect-lock-wait-stops")
	cfg.ShutdownTimeout = time.Minute

	// Another process's attempt of the message holds its lock: the key is
	// the consumer's name and the event id in its store's attempts table.
	store := migratedStore(t, pool)
	other, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer other.Release()
	_, err = other.Exec(ctx, `SELECT pg_advisory_lock(hashtext($1), hashtext(to_regclass($2)::oid::text || ':' || $3))`,
		cfg.Name, store.AttemptsTable(), "busy")
	require.NoError(t, err)
	defer func() {
		_, _ = other.Exec(ctx, `SELECT pg_advisory_unlock_all()`)
	}()

	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool {
		var waiting int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted`).Scan(&waiting)
		return err == nil && waiting == 1
	}, 20*time.Second, 5*time.Millisecond, "the suspect waits for its lock")

	stopped := make(chan error, 1)
	began := time.Now()
	go func() { stopped <- stop() }()
	select {
	case err := <-stopped:
		require.NoError(t, err)
	case <-time.After(cfg.ShutdownTimeout / 2):
		t.Fatalf("Run has not returned %v after its context ended: the suspect's wait for its lock holds it", time.Since(began))
	}
	assert.Zero(t, b.Acked(), "the message never ran: left unacked")
	assert.Empty(t, countEffects(t, pool))
}
