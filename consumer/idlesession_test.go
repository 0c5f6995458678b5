package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// A server (or role) with idle_session_timeout ends a session left idle
// outside a transaction longer than that, with FATAL 57P05; the client
// meets it at its next statement on that connection (a pooled connection
// that waited between bursts). The connection is gone, as after an
// administrator's pg_terminate_backend (57P01): retrying on another
// connection cures it. It was classified as the statement's own failure
// (ClassRetry), so a handler's read through the pool counted it against
// Retry.MaxAttempts and IsTransient said no (the idempotency middleware
// answered 500, not 503).
func TestIdleSessionTimeoutIsInfrastructure(t *testing.T) {
	cfg, err := pgx.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	cfg.RuntimeParams["idle_session_timeout"] = "20ms"
	ctx := context.Background()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	require.NoError(t, err)
	defer func() { _ = conn.Close(ctx) }()
	admin, _ := pgtest.Schema(t)
	pid := conn.PgConn().PID()
	require.Eventually(t, func() bool {
		var alive bool
		require.NoError(t, admin.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)`, pid).Scan(&alive))
		return !alive
	}, 10*time.Second, 10*time.Millisecond, "the server ends the idle session")
	var one int
	err = conn.QueryRow(ctx, `SELECT 1`).Scan(&one)
	require.Error(t, err, "the session was ended by the server")
	assert.Equal(t, "57P05", sqlStateOf(err), "%v", err)
	assert.Equal(t, consumer.ClassInfrastructure, consumer.Classify(err))
	assert.True(t, consumer.IsTransient(err))
}
