package bench

import (
	"bytes"
	"image"
	"image/png"
	"testing"

	"github.com/stretchr/testify/require"
)

// markerAt reports whether the plot has its first series' colour within
// a few pixels of (x, y).
func markerAt(img image.Image, x, y int) bool {
	want := plotColors[0]
	for dy := -3; dy <= 3; dy++ {
		for dx := -3; dx <= 3; dx++ {
			r, g, b, _ := img.At(x+dx, y+dy).RGBA()
			if uint8(r>>8) == want.R && uint8(g>>8) == want.G && uint8(b>>8) == want.B {
				return true
			}
		}
	}
	return false
}

// TestPlotOfOneTableSize: a scale run of one step (-scale-steps 0) plots
// its points at x 0, and a row that measured 0 msgs/s at y 0: each marker
// is drawn where its axes meet it, not off the image.
func TestPlotOfOneTableSize(t *testing.T) {
	for _, s := range []Series{
		{Name: "x zero", X: []float64{0}, Y: []float64{40000}},
		{Name: "y zero", X: []float64{0, 1}, Y: []float64{0, 0}},
	} {
		var buf bytes.Buffer
		require.NoError(t, Plot(&buf, "msgs/s", []Series{s}))
		img, err := png.Decode(&buf)
		require.NoError(t, err)
		// The first point: x 0 is the left axis; y is the top of the
		// plot for the one value, its bottom for 0.
		y := marginT
		if s.Y[0] == 0 {
			y = plotH - marginB
		}
		require.True(t, markerAt(img, marginL, y), "%s: no marker at (%d, %d)", s.Name, marginL, y)
	}
}
