// Package field cuts the fields of a dead letter that a person reads, a
// Kafka key and a header's name or value, to what a page of the console
// or a terminal can show: a producer's may be as large as the record
// (the consumer's own diagnostic headers are at most 4 KiB), and a few of
// them whole are as hard to read as a huge payload.
package field

import (
	"strconv"
	"unicode/utf8"

	"github.com/onceco/once/cmd/once/dlq"
)

// Shown is how many bytes of a field are shown: 4 KiB.
const Shown = 4 << 10

// Cut returns the first Shown bytes of b (b itself when it is no longer),
// cut at the start of a character when b is printable text
// (dlq.Printable), and whether that is not all of b.
func Cut(b []byte) (shown []byte, cut bool) {
	if len(b) <= Shown {
		return b, false
	}
	shown = b[:Shown]
	if dlq.Printable(b) {
		for len(shown) > 0 && !utf8.RuneStart(b[len(shown)]) {
			shown = shown[:len(shown)-1]
		}
	}
	return shown, true
}

// Count returns n in decimal with a comma between groups of three digits
// ("4,096"), as the console and the command print sizes.
func Count(n int) string {
	s := strconv.Itoa(n)
	for i := len(s) - 3; i > 0 && s[i-1] != '-'; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
