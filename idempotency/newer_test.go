package idempotency_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

// A table a newer release migrated is refused with an error a caller can
// tell from an outage (errors.Is ErrSchemaNewer), and left as it is.
func TestMigrateRefusesANewerSchemaWithErrSchemaNewer(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgtest.Schema(t)
	require.NoError(t, idempotency.Migrate(ctx, pool, schema))
	_, err := pool.Exec(ctx, `INSERT INTO once_schema_versions (component, version, name) VALUES ('idempotency:idempotency_keys', 99, 'future')`)
	require.NoError(t, err)

	err = idempotency.Migrate(ctx, pool, schema)
	require.Error(t, err)
	assert.True(t, errors.Is(err, idempotency.ErrSchemaNewer), "%v", err)
	assert.Contains(t, err.Error(), "version 99")
	assert.Equal(t, 0, count(t, pool, `SELECT count(*) FROM idempotency_keys`), "the table is still there, unchanged")
}
