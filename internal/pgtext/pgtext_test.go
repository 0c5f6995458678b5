package pgtext_test

import (
	"testing"

	"github.com/onceco/once/internal/pgtext"
)

func TestStorable(t *testing.T) {
	for _, tc := range []struct {
		s    string
		want bool
	}{
		{"", true},
		{"evt-1", true},
		{"événement 事件 🎉", true},
		{"tab\tand\nnewline", true},
		{"\x00", false},
		{"evt\x00-1", false},
		{"evt-1\x00", false},
		{"evt-\xff", false},          // not UTF-8
		{"orders\xc3", false},        // a truncated sequence
		{"\xed\xa0\x80", false},      // a surrogate half
		{"\xc0\x80", false},          // an overlong NUL
		{string(rune(0xFFFD)), true}, // the replacement character itself
	} {
		if got := pgtext.Storable(tc.s); got != tc.want {
			t.Errorf("Storable(%q) = %v, want %v", tc.s, got, tc.want)
		}
	}
}
