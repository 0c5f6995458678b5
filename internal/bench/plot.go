package bench

import (
	"fmt"
	"image"
	"image/color"
	"image/png"
	"io"
	"math"
	"strings"
)

// Series is one line of a plot.
type Series struct {
	Name string
	X, Y []float64
}

// The plot's geometry, in pixels.
const (
	plotW, plotH                         = 1000, 520
	marginL, marginR, marginT, marginB   = 80, 300, 40, 50
	glyphW, glyphH, glyphScale, glyphGap = 5, 7, 2, 1
)

var plotColors = []color.RGBA{
	{0x1f, 0x77, 0xb4, 0xff}, {0xd6, 0x27, 0x28, 0xff}, {0x2c, 0xa0, 0x2c, 0xff},
	{0xff, 0x7f, 0x0e, 0xff}, {0x94, 0x67, 0xbd, 0xff}, {0x8c, 0x56, 0x4b, 0xff},
}

// Plot draws the series as lines with markers on linear axes starting at
// zero, with a title and a legend, and writes a PNG. It needs nothing but
// the standard library: the labels use a small built-in bitmap font.
func Plot(w io.Writer, title string, series []Series) error {
	img := image.NewRGBA(image.Rect(0, 0, plotW, plotH))
	fillRect(img, img.Bounds(), color.RGBA{0xff, 0xff, 0xff, 0xff})
	maxX, maxY := 0.0, 0.0
	for _, s := range series {
		for i := range s.X {
			maxX, maxY = math.Max(maxX, s.X[i]), math.Max(maxY, s.Y[i])
		}
	}
	xStep, yStep := niceStep(maxX), niceStep(maxY)
	// An axis whose values are all 0 (one table size, a row at 0 msgs/s)
	// still spans a step, so that its points have somewhere to go.
	maxX, maxY = xStep*max(1, math.Ceil(maxX/xStep)), yStep*max(1, math.Ceil(maxY/yStep))
	px := func(x float64) int { return marginL + int(x/maxX*float64(plotW-marginL-marginR)) }
	py := func(y float64) int { return plotH - marginB - int(y/maxY*float64(plotH-marginT-marginB)) }
	grey, black := color.RGBA{0xdd, 0xdd, 0xdd, 0xff}, color.RGBA{0, 0, 0, 0xff}
	for y := 0.0; y <= maxY+yStep/2; y += yStep {
		line(img, px(0), py(y), px(maxX), py(y), grey)
		label := fmt.Sprintf("%.0f", y)
		text(img, marginL-8-textWidth(label), py(y)-glyphH, label, black)
	}
	for x := 0.0; x <= maxX+xStep/2; x += xStep {
		line(img, px(x), py(0), px(x), py(maxY), grey)
		label := strings.TrimSuffix(strings.TrimRight(fmt.Sprintf("%.2f", x), "0"), ".")
		text(img, px(x)-textWidth(label)/2, plotH-marginB+8, label, black)
	}
	line(img, px(0), py(0), px(maxX), py(0), black)
	line(img, px(0), py(0), px(0), py(maxY), black)
	text(img, marginL, 12, title, black)
	for i, s := range series {
		c := plotColors[i%len(plotColors)]
		for j := range s.X {
			if j > 0 {
				thickLine(img, px(s.X[j-1]), py(s.Y[j-1]), px(s.X[j]), py(s.Y[j]), c)
			}
			fillRect(img, image.Rect(px(s.X[j])-3, py(s.Y[j])-3, px(s.X[j])+4, py(s.Y[j])+4), c)
		}
		ly := marginT + 10 + 24*i
		fillRect(img, image.Rect(plotW-marginR+16, ly, plotW-marginR+30, ly+14), c)
		text(img, plotW-marginR+38, ly, s.Name, black)
	}
	return png.Encode(w, img)
}

// niceStep returns a grid step of 1, 2 or 5 times a power of ten that
// cuts [0, max] into 4 to 10 parts.
func niceStep(max float64) float64 {
	if max <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(max)))
	for _, m := range []float64{0.1, 0.2, 0.5, 1, 2, 5} {
		if max/(m*p) <= 10 {
			return m * p
		}
	}
	return 10 * p
}

func fillRect(img *image.RGBA, r image.Rectangle, c color.RGBA) {
	r = r.Intersect(img.Bounds())
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			img.SetRGBA(x, y, c)
		}
	}
}

// line draws a one-pixel line (DDA).
func line(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA) {
	n := max(abs(x1-x0), abs(y1-y0), 1)
	for i := 0; i <= n; i++ {
		img.SetRGBA(x0+(x1-x0)*i/n, y0+(y1-y0)*i/n, c)
	}
}

func thickLine(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA) {
	for d := -1; d <= 1; d++ {
		line(img, x0, y0+d, x1, y1+d, c)
		line(img, x0+d, y0, x1+d, y1, c)
	}
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

func textWidth(s string) int { return len(s) * (glyphW + glyphGap) * glyphScale }

// text draws s with its top-left corner at (x, y); characters without a
// glyph are left blank.
func text(img *image.RGBA, x, y int, s string, c color.RGBA) {
	for _, r := range strings.ToLower(s) {
		if g, ok := glyphs[r]; ok {
			for row, bits := range g {
				for col, b := range bits {
					if b == '#' {
						fillRect(img, image.Rect(x+col*glyphScale, y+row*glyphScale, x+(col+1)*glyphScale, y+(row+1)*glyphScale), c)
					}
				}
			}
		}
		x += (glyphW + glyphGap) * glyphScale
	}
}

// glyphs is a 5x7 bitmap font of what the plots print.
var glyphs = map[rune][glyphH]string{
	'0': {" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "},
	'1': {"  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "},
	'2': {" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"},
	'3': {"#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "},
	'4': {"   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "},
	'5': {"#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "},
	'6': {"  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "},
	'7': {"#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "},
	'8': {" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "},
	'9': {" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "},
	'a': {"     ", "     ", " ### ", "    #", " ####", "#   #", " ####"},
	'b': {"#    ", "#    ", "# ## ", "##  #", "#   #", "#   #", "#### "},
	'c': {"     ", "     ", " ### ", "#    ", "#    ", "#   #", " ### "},
	'd': {"    #", "    #", " ## #", "#  ##", "#   #", "#   #", " ####"},
	'e': {"     ", "     ", " ### ", "#   #", "#####", "#    ", " ### "},
	'f': {"  ## ", " #  #", " #   ", "###  ", " #   ", " #   ", " #   "},
	'g': {"     ", " ####", "#   #", "#   #", " ####", "    #", " ### "},
	'h': {"#    ", "#    ", "# ## ", "##  #", "#   #", "#   #", "#   #"},
	'i': {"  #  ", "     ", " ##  ", "  #  ", "  #  ", "  #  ", " ### "},
	'j': {"   # ", "     ", "  ## ", "   # ", "   # ", "#  # ", " ##  "},
	'k': {"#    ", "#    ", "#  # ", "# #  ", "##   ", "# #  ", "#  # "},
	'l': {" ##  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "},
	'm': {"     ", "     ", "## # ", "# # #", "# # #", "#   #", "#   #"},
	'n': {"     ", "     ", "# ## ", "##  #", "#   #", "#   #", "#   #"},
	'o': {"     ", "     ", " ### ", "#   #", "#   #", "#   #", " ### "},
	'p': {"     ", "     ", "#### ", "#   #", "#### ", "#    ", "#    "},
	'q': {"     ", "     ", " ## #", "#  ##", " ####", "    #", "    #"},
	'r': {"     ", "     ", "# ## ", "##  #", "#    ", "#    ", "#    "},
	's': {"     ", "     ", " ### ", "#    ", " ### ", "    #", "#### "},
	't': {" #   ", " #   ", "###  ", " #   ", " #   ", " #  #", "  ## "},
	'u': {"     ", "     ", "#   #", "#   #", "#   #", "#  ##", " ## #"},
	'v': {"     ", "     ", "#   #", "#   #", "#   #", " # # ", "  #  "},
	'w': {"     ", "     ", "#   #", "#   #", "# # #", "# # #", " # # "},
	'x': {"     ", "     ", "#   #", " # # ", "  #  ", " # # ", "#   #"},
	'y': {"     ", "     ", "#   #", "#   #", " ####", "    #", " ### "},
	'z': {"     ", "     ", "#####", "   # ", "  #  ", " #   ", "#####"},
	'.': {"     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "},
	',': {"     ", "     ", "     ", "     ", " ##  ", "  #  ", " #   "},
	'-': {"     ", "     ", "     ", "#####", "     ", "     ", "     "},
	'_': {"     ", "     ", "     ", "     ", "     ", "     ", "#####"},
	'/': {"     ", "    #", "   # ", "  #  ", " #   ", "#    ", "     "},
	'(': {"   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # "},
	')': {" #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   "},
	'%': {"##   ", "##  #", "   # ", "  #  ", " #   ", "#  ##", "   ##"},
}
