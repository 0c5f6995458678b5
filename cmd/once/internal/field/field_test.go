package field_test

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/onceco/once/cmd/once/internal/field"
)

// A field is cut to field.Shown bytes, text at the start of a character
// (a cut inside one would show a broken character), bytes that are not
// text where the count falls.
func TestCutKeepsCharactersWhole(t *testing.T) {
	short := []byte("order-1")
	shown, cut := field.Cut(short)
	assert.Equal(t, short, shown)
	assert.False(t, cut)
	exact := bytes.Repeat([]byte("x"), field.Shown)
	shown, cut = field.Cut(exact)
	assert.Equal(t, field.Shown, len(shown))
	assert.False(t, cut, "a field of exactly field.Shown bytes is whole")

	// "xy" then three-byte characters: byte field.Shown (4,096 = 2 +
	// 3*1,364 + 2) is the third of one.
	text := append([]byte("xy"), bytes.Repeat([]byte("東"), field.Shown)...)
	shown, cut = field.Cut(text)
	assert.True(t, cut)
	assert.Equal(t, field.Shown-2, len(shown), "cut before the character byte field.Shown falls in")
	binary := append([]byte{0xff, 'y'}, bytes.Repeat([]byte("東"), field.Shown)...)
	shown, cut = field.Cut(binary)
	assert.True(t, cut)
	assert.Equal(t, field.Shown, len(shown), "bytes that are not text are cut at field.Shown")
}

func TestCount(t *testing.T) {
	for n, want := range map[int]string{0: "0", 999: "999", 4096: "4,096", 1 << 20: "1,048,576", -1234567: "-1,234,567", -123: "-123"} {
		assert.Equal(t, want, field.Count(n))
	}
}
