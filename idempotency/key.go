package idempotency

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/onceco/once/internal/pgtext"
)

// parseKey returns the key a header value carries. The draft defines the
// value as a Structured Field String ("..." with \" and \\ escapes); many
// clients (Stripe's among them) send the key bare, so a value that does not
// start with a quote is taken as it is. Either way the key must be 1 to
// MaxKeyLength bytes of printable ASCII.
func parseKey(value string) (string, error) {
	value = strings.TrimSpace(value)
	key := value
	if strings.HasPrefix(value, `"`) {
		var err error
		if key, err = parseSFString(value); err != nil {
			return "", err
		}
	}
	switch {
	case key == "":
		return "", errors.New("the key is empty")
	case len(key) > MaxKeyLength:
		return "", fmt.Errorf("the key is %d bytes long; at most %d are accepted", len(key), MaxKeyLength)
	}
	for i := 0; i < len(key); i++ {
		if key[i] < 0x20 || key[i] > 0x7e {
			return "", fmt.Errorf("the key holds a byte (0x%02x) outside printable ASCII", key[i])
		}
	}
	return key, nil
}

// parseSFString parses an RFC 8941 String: a quoted value in which only \"
// and \\ are escapes, and nothing follows the closing quote.
func parseSFString(v string) (string, error) {
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		switch c := v[i]; c {
		case '\\':
			i++
			if i == len(v) || v[i] != '"' && v[i] != '\\' {
				return "", errors.New(`the quoted key has an escape other than \" or \\`)
			}
			b.WriteByte(v[i])
		case '"':
			if i != len(v)-1 {
				return "", errors.New("the quoted key is followed by more characters")
			}
			return b.String(), nil
		default:
			b.WriteByte(c)
		}
	}
	return "", errors.New("the quoted key has no closing quote")
}

// maxStoredScope is the longest scope, in bytes, stored as it is. A
// longer scope, one that is not valid UTF-8 or holds a NUL byte (neither
// is PostgreSQL text), or one that starts with a reserved prefix is stored
// as hashedScopePrefix and the hex SHA-256 of its bytes: the table's
// primary key holds the scope, and PostgreSQL refuses an index row of
// more than about 2.7 kB.
const maxStoredScope = 2048

// hashedScopePrefix starts the stored form of a hashed scope. A scope
// that itself starts with it is hashed too, so that no scope stored as it
// is can equal another's hash.
const hashedScopePrefix = "once:sha256:"

// servicePrefix starts the stored form of a scope of a named service
// (Config.Service): the prefix, the service's length and name, and the
// scope, "once:service:6:orders:alice". A scope of an unnamed service
// that starts with it is hashed, so that it cannot pose as a named
// service's.
const servicePrefix = "once:service:"

// hashedServicePrefix starts the stored form of a named service's scope
// too long (or not text) to be stored as it is: no form stored as it is
// starts with it (a service's length is digits), nor does a hashed scope
// of an unnamed service.
const hashedServicePrefix = servicePrefix + "sha256:"

// storedScope is the form of scope of service kept in the table: for
// the unnamed service (""), scope itself, or its hash when it cannot or
// must not be stored as it is, as before services were named; for a named
// one, the scope behind servicePrefix and the service, or its hash. Each
// form starts differently, so that no two services' scopes meet.
func storedScope(service, scope string) string {
	if service == "" {
		if len(scope) <= maxStoredScope && pgtext.Storable(scope) &&
			!strings.HasPrefix(scope, hashedScopePrefix) && !strings.HasPrefix(scope, servicePrefix) {
			return scope
		}
		return hashedScopePrefix + sha256Hex(scope)
	}
	named := servicePrefix + strconv.Itoa(len(service)) + ":" + service + ":" + scope
	if len(named) <= maxStoredScope && pgtext.Storable(named) {
		return named
	}
	return hashedServicePrefix + sha256Hex(named)
}

// sha256Hex is the hex SHA-256 of s.
func sha256Hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// storedPath is the form of a request's path kept in the table: the
// decoded path, or, when its escapes decode to bytes PostgreSQL text
// cannot hold (a NUL, bytes that are not UTF-8), the path as escaped on
// the wire, which always can.
func storedPath(u *url.URL) string {
	if pgtext.Storable(u.Path) {
		return u.Path
	}
	return u.EscapedPath()
}
