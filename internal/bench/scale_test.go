package bench

import (
	"bytes"
	"context"
	"image/png"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// TestScaleSmoke runs bench-scale with a small table: every run's effects
// exactly right, a point per row and step, both plans captured, retention
// deleting the expired half of the fill, the keyset sweep the next
// quarter, and a plot that decodes.
func TestScaleSmoke(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	o := ScaleOptions{
		TableRows:       40000,
		Steps:           []float64{0, 1},
		Workload:        Workload{Events: 400, DupEvery: 10, PoisonEvery: 50, Partitions: 4},
		Rows:            []Row{RowHandwritten, RowOnceBatchHandler},
		RetentionEvents: 400,
		DatabaseURL:     pgtest.URL(),
	}
	rep, err := RunScale(ctx, o)
	require.NoError(t, err)
	require.True(t, rep.Correct())
	require.Len(t, rep.Points, 4)
	for _, p := range rep.Points {
		require.True(t, p.Correct, "%s at %d rows: %s", p.Row, p.TableRows, p.Check)
		require.Positive(t, p.Rate)
	}
	require.Len(t, rep.Fill, 1)
	require.Equal(t, int64(40000), rep.Fill[0].Added)
	require.Positive(t, rep.Fill[0].Size.PKBytes)
	require.Contains(t, rep.Plans["library batch claim"], "processed_events_pkey")
	require.Contains(t, rep.Plans["hand-written claim"], "Conflict Resolution: NOTHING")

	ret := rep.Retention
	require.NotNil(t, ret)
	require.True(t, ret.Correct, ret.Check)
	require.Equal(t, RowOnceBatchHandler, ret.Row)
	// processed_at rises over 14 days: the first half is past the cutoff.
	require.InDelta(t, 20000, ret.Deleted, 3000)
	require.Less(t, ret.After.Rows, ret.Before.Rows)
	require.Zero(t, ret.AfterVacuum.DeadTuples)
	// Then the keyset sweep expires what is older than 3.5 days: 3.5 of
	// the 14 days of the fill.
	require.NotNil(t, ret.Keyset)
	require.True(t, ret.Keyset.Correct, ret.Keyset.Check)
	require.InDelta(t, 10000, ret.Keyset.Deleted, 2000)
	require.NotNil(t, rep.Project(100_000_000))

	var buf bytes.Buffer
	require.NoError(t, rep.WriteTable(&buf))
	require.Contains(t, buf.String(), "retention while consuming")
	buf.Reset()
	require.NoError(t, Plot(&buf, "msgs/s", []Series{{Name: "a", X: []float64{0, 1}, Y: []float64{10, 20}}}))
	img, err := png.Decode(&buf)
	require.NoError(t, err)
	require.Equal(t, plotW, img.Bounds().Dx())
}

// A retention duty cycle out of (0, 1] is refused before anything runs,
// not after the fill and every measured row, when the retention phase
// would have failed on it and taken the whole report with it.
func TestScaleRefusesABadDutyCycleFirst(t *testing.T) {
	for _, duty := range []float64{1.5, 2} {
		_, err := RunScale(context.Background(), ScaleOptions{RetentionDuty: duty, DatabaseURL: "postgres://127.0.0.1:1/none"})
		require.Error(t, err)
		require.Contains(t, err.Error(), "RetentionDuty", "duty %v", duty)
	}
}
