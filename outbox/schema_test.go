package outbox_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
)

// A table named like the outbox that Migrate did not create (another
// library's outbox, a hand-made copy with other types) was adopted as
// version 1 without a look at its columns: Migrate succeeded and recorded
// the version, so that every Add then failed on a missing column (and a
// later Migrate, the table renamed away, created nothing), or, for a body
// column of type text, Add stored the body's hex escape, which the relay
// published as the message. Migrate refuses such a table now, naming what
// differs, and records nothing.
func TestMigrateRefusesATableOfAnotherShape(t *testing.T) {
	ctx := context.Background()
	for name, ddl := range map[string]string{
		"another library's": `CREATE TABLE outbox (id bigserial PRIMARY KEY, aggregate text NOT NULL, payload jsonb NOT NULL)`,
		"body of type text": `CREATE TABLE outbox (
    seq         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id    text        NOT NULL,
    topic       text        NOT NULL,
    routing_key text        NOT NULL DEFAULT '',
    key         bytea,
    type        text        NOT NULL DEFAULT '',
    headers     jsonb       NOT NULL DEFAULT '{}',
    trace       jsonb       NOT NULL DEFAULT '{}',
    body        text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    attempts    integer     NOT NULL DEFAULT 0,
    not_before  timestamptz,
    last_error  text,
    parked_at   timestamptz,
    sent_at     timestamptz)`,
	} {
		t.Run(name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			_, err := pool.Exec(ctx, ddl)
			require.NoError(t, err)
			err = outbox.Migrate(ctx, pool)
			require.ErrorIs(t, err, outbox.ErrSchemaMismatch)
			switch name {
			case "another library's":
				assert.ErrorContains(t, err, "column event_id (text) is missing")
				assert.ErrorContains(t, err, "column aggregate is NOT NULL without a default")
			default:
				assert.ErrorContains(t, err, "column body is text, want bytea")
			}
			var versions *string
			require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass('once_schema_versions')::text`).Scan(&versions))
			if versions != nil {
				var recorded bool
				require.NoError(t, pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM once_schema_versions WHERE component LIKE 'outbox:%')`).Scan(&recorded))
				assert.False(t, recorded, "no version recorded for a table Migrate did not make")
			}
			// A relay that does not migrate refuses it at start too.
			r, err := outbox.NewRelay(pool, nopPublisher{}, outbox.RelayConfig{SkipMigrate: true, Logger: testLogger()})
			require.NoError(t, err)
			require.ErrorIs(t, r.Run(ctx), outbox.ErrSchemaMismatch)
		})
	}
}

// The outbox's own table, however it was made, passes.
func TestCheckAcceptsTheOutboxTable(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(t)
	s, err := outbox.New(outbox.Config{})
	require.NoError(t, err)
	require.ErrorIs(t, s.Check(ctx, pool), outbox.ErrSchemaMismatch, "no table yet")
	_, err = pool.Exec(ctx, s.SchemaSQL())
	require.NoError(t, err)
	require.NoError(t, s.Check(ctx, pool))
	require.NoError(t, s.Migrate(ctx, pool), "adopted")
}

// nopPublisher confirms everything.
type nopPublisher struct{}

func (nopPublisher) Publish(context.Context, []outbox.Record) []error { return nil }
func (nopPublisher) Close() error                                     { return nil }
