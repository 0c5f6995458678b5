package idempotency_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

// A Fingerprint that returns nil stores none (Config.Fingerprint): the
// claim writes NULL into fingerprint. A table made by hand with
// fingerprint NOT NULL was adopted by Migrate as it was, and under such a
// Fingerprint every request's claim was refused. Migrate refuses the
// table now, naming the column.
func TestMigrateRefusesAFingerprintThatRefusesNull(t *testing.T) {
	pool, schema := pgtest.Schema(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, body text NOT NULL)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, strings.Replace(keysDDL, "fingerprint     bytea,", "fingerprint     bytea NOT NULL,", 1))
	require.NoError(t, err)
	err = idempotency.Migrate(ctx, pool, schema)
	if err == nil {
		// What the adopted table does.
		none := func(*http.Request, []byte) []byte { return nil }
		s := serve(t, pool, schema, idempotency.Config{Fingerprint: none}, http.HandlerFunc(insertEffect))
		first := s.post("/orders", "k", "b")
		assert.Equal(t, http.StatusCreated, first.status, first.body)
		t.Fatal("Migrate adopted a table whose fingerprint column refuses the NULL the claim writes")
	}
	require.ErrorIs(t, err, idempotency.ErrSchemaMismatch)
	assert.Contains(t, err.Error(), "column fingerprint is NOT NULL")
}
