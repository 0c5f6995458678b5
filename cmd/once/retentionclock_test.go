package main

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// once retention -older-than measures the age of a row by the database's
// clock, which wrote processed_at: with the database's clock two hours
// behind this host's, -older-than 3h deleted rows two hours old by the
// database (the cutoff came from this host's clock), and the dry run
// counted them.
func TestRetentionOlderThanIsMeasuredByTheDatabaseClock(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, pool))
	skewed, path := pgtest.SkewedClock(t, schema, -2*time.Hour)
	for id, age := range map[string]string{"within": "2 hours", "expired": "4 hours"} {
		require.NoError(t, pgx.BeginFunc(ctx, skewed, func(tx pgx.Tx) error {
			if _, err := store.Claim(ctx, tx, dedup.Claim{Consumer: "billing", EventID: id, Partition: -1, Offset: -1}); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `UPDATE processed_events SET processed_at = now() - $2::interval
				WHERE consumer = 'billing' AND event_id = $1`, id, age)
			return err
		}))
	}
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(path)}

	for _, dry := range []bool{true, false} {
		args := []string{"retention", "-consumer", "billing", "-older-than", "3h", "-json"}
		if dry {
			args = append(args, "-dry-run")
		}
		code, out, errOut := cli(t, env, args...)
		require.Equal(t, exitOK, code, errOut)
		var rep map[string]any
		require.NoError(t, json.Unmarshal([]byte(out), &rep))
		assert.EqualValues(t, 1, rep["deleted"], "dry run %v: only the row older than 3h by the database's clock", dry)
	}
	var left []string
	rows, err := pool.Query(ctx, `SELECT event_id FROM processed_events WHERE consumer = 'billing'`)
	require.NoError(t, err)
	left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	assert.Equal(t, []string{"within"}, left)
}
