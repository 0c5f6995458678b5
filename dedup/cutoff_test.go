package dedup_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// Cutoff reads the database's clock, not the caller's: with a session
// whose now() is two hours behind this host's, the cutoff for an age of
// one hour is about three hours before this host's now. An age that is not
// positive is an error, asked of no database.
func TestCutoffIsTheDatabaseClockLessTheAge(t *testing.T) {
	ctx := context.Background()
	_, schema := pgtest.Schema(t)
	skewed, _ := pgtest.SkewedClock(t, schema, -2*time.Hour)

	cutoff, err := dedup.Cutoff(ctx, skewed, time.Hour)
	require.NoError(t, err)
	assert.WithinDuration(t, time.Now().Add(-3*time.Hour), cutoff, time.Minute)

	for _, age := range []time.Duration{0, -time.Hour} {
		_, err := dedup.Cutoff(ctx, nil, age)
		assert.ErrorContains(t, err, "not positive", "age %v", age)
	}
}
