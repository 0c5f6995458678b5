package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The demo's own verdict (exactly-once ledger, poison dead-lettered) must
// pass; run returns an error when it does not.
func TestDemoVerdictPasses(t *testing.T) {
	t.Setenv("DATABASE_URL", pgtest.URL())
	require.NoError(t, run(600))
}
