package main

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// A retention whose -consumer has no rows (a typo, most often) deleted
// nothing and said only "deleted 0 rows", as it does for a consumer with
// no row old enough: the rows of the consumer meant were never deleted,
// and nothing told. It now warns on stderr, naming the consumers that have
// rows, and still exits 0 (a consumer idle for longer than the window has
// no rows either, which a scheduled job must not fail on).
func TestRetentionWarnsOfAConsumerWithNoRows(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	env := map[string]string{"DATABASE_URL": testenv.SchemaURL(schema)}
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, pool))

	code, _, errOut := cli(t, env, "retention", "-consumer", "biling", "-older-than", "1h")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, errOut, `"biling"`, "an empty table: the name is warned of")
	assert.Contains(t, errOut, "no consumer has rows")

	for _, name := range []string{"billing", "shipping"} {
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := store.Claim(ctx, tx, dedup.Claim{Consumer: name, EventID: "e-1", Partition: -1, Offset: -1})
			return err
		}))
	}
	for _, args := range [][]string{nil, {"-dry-run"}, {"-json"}} {
		code, out, errOut := cli(t, env, append([]string{"retention", "-consumer", "biling", "-older-than", "1h"}, args...)...)
		require.Equal(t, exitOK, code, "%v: %s", args, errOut)
		assert.Contains(t, errOut, `consumer "biling" has no rows`, "%v", args)
		assert.Contains(t, errOut, "billing, shipping", "%v: the consumers that have rows", args)
		if len(args) > 0 && args[0] == "-json" {
			var rep map[string]any
			require.NoError(t, json.Unmarshal([]byte(out), &rep))
			assert.Equal(t, false, rep["consumer_has_rows"])
		}
	}

	// A consumer with rows, none old enough: no warning.
	code, out, errOut := cli(t, env, "retention", "-consumer", "billing", "-older-than", "1h", "-json")
	require.Equal(t, exitOK, code, errOut)
	assert.NotContains(t, errOut, "no rows")
	var rep map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	assert.Equal(t, true, rep["consumer_has_rows"])
	assert.EqualValues(t, 0, rep["deleted"])
}
