package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceco/once/oncetest"
)

// The demo's own verdict (exactly-once ledger, poison dead-lettered) must
// pass; run returns an error when it does not.
func TestDemoVerdictPasses(t *testing.T) {
	t.Setenv("DATABASE_URL", oncetest.URL(t))
	require.NoError(t, run(600))
}

// With nothing published there is no crash to recover from: the demo must
// not pass as if it had shown one.
func TestDemoFailsWhenNoAckWasLost(t *testing.T) {
	t.Setenv("DATABASE_URL", oncetest.URL(t))
	err := run(0)
	require.Error(t, err)
	require.Contains(t, err.Error(), "redelivered")
}
