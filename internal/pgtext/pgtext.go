package pgtext

import (
	"strings"
	"unicode/utf8"
)

// Storable reports whether PostgreSQL's text type holds s as it is: s is
// valid UTF-8 and holds no NUL byte.
// The empty string is storable.
func Storable(s string) bool {
	return utf8.ValidString(s) && strings.IndexByte(s, 0) < 0
}
