package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
)

// Add leaves created_at, attempts and waiting out, for their defaults to
// fill. A table made by hand (RelayConfig.SkipMigrate, a DBA's DDL)
// without those defaults passed Check and Migrate: each row got NULL
// there, and the relay's read (NOT waiting) passed over a NULL waiting
// for ever, without a word, while a NULL attempts or created_at failed
// every read's scan, so that nothing was published. So was every message
// without a key refused, in a table whose key column is NOT NULL. Check
// names each such column now, and the fixed table is published from.
func TestCheckRefusesColumnsAddAndTheRelayCannotFill(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(ctx, `CREATE TABLE outbox (
    seq         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id    text        NOT NULL,
    topic       text        NOT NULL,
    routing_key text        NOT NULL DEFAULT '',
    key         bytea       NOT NULL,
    type        text        NOT NULL DEFAULT '',
    headers     jsonb       NOT NULL DEFAULT '{}',
    trace       jsonb       NOT NULL DEFAULT '{}',
    body        bytea       NOT NULL,
    created_at  timestamptz,
    attempts    integer,
    not_before  timestamptz,
    last_error  text,
    parked_at   timestamptz,
    sent_at     timestamptz,
    waiting     boolean)`)
	require.NoError(t, err)
	s, err := outbox.New(outbox.Config{})
	require.NoError(t, err)

	err = s.Check(ctx, pool)
	require.ErrorIs(t, err, outbox.ErrSchemaMismatch)
	for _, col := range []string{"created_at", "attempts", "waiting"} {
		assert.ErrorContains(t, err, "column "+col+" has no default")
	}
	assert.ErrorContains(t, err, "column key is NOT NULL, and Add or the relay writes NULL there")
	require.ErrorIs(t, s.Migrate(ctx, pool), outbox.ErrSchemaMismatch, "Migrate adopts no such table")
	r, err := outbox.NewRelay(pool, nopPublisher{}, outbox.RelayConfig{SkipMigrate: true, Logger: testLogger()})
	require.NoError(t, err)
	require.ErrorIs(t, r.Run(ctx), outbox.ErrSchemaMismatch, "a relay that does not migrate refuses it at start")

	_, err = pool.Exec(ctx, `ALTER TABLE outbox ALTER COLUMN key DROP NOT NULL,
	ALTER COLUMN created_at SET DEFAULT now(), ALTER COLUMN attempts SET DEFAULT 0, ALTER COLUMN waiting SET DEFAULT false`)
	require.NoError(t, err)
	require.NoError(t, s.Check(ctx, pool))
	addCommitted(t, pool, outbox.Message{ID: "e1", Topic: "t", Body: []byte("b")})
	startRelay(t, pool, nopPublisher{}, outbox.RelayConfig{SkipMigrate: true})
	waitRows(t, pool, "true", 0, 30*time.Second) // published, then deleted
}
