package idempotency

import (
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseKey(t *testing.T) {
	for in, want := range map[string]string{
		"abc":                   "abc",
		`"abc"`:                 "abc",
		`  "a b"  `:             "a b",
		`"a\"b\\c"`:             `a"b\c`,
		"8e03978e-40d5-43e8-bc": "8e03978e-40d5-43e8-bc",
	} {
		got, err := parseKey(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, in := range []string{"", `""`, `"abc`, `"a"b`, `"a\b"`, "tab\tkey", "é", strings.Repeat("k", MaxKeyLength+1)} {
		_, err := parseKey(in)
		assert.Error(t, err, "%q", in)
	}
}

// Whatever a client sends, an accepted key is 1 to MaxKeyLength bytes of
// printable ASCII, and its quoted form names the same key.
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{"abc", `"abc"`, `"a\"b"`, `"\\"`, "", `"`, "\x00", strings.Repeat("x", 300)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		key, err := parseKey(in)
		if err != nil {
			return
		}
		require.NotEmpty(t, key)
		require.LessOrEqual(t, len(key), MaxKeyLength)
		for i := 0; i < len(key); i++ {
			require.True(t, key[i] >= 0x20 && key[i] <= 0x7e, "%q", key)
		}
		quoted := `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(key) + `"`
		again, err := parseKey(quoted)
		require.NoError(t, err, quoted)
		require.Equal(t, key, again)
	})
}

// The buffered writer: 200 when the handler writes no status, the first
// final status wins, 1xx are dropped, and the limit holds.
func TestRecorder(t *testing.T) {
	r := newRecorder(10)
	assert.Equal(t, http.StatusOK, r.finalStatus())
	r.WriteHeader(http.StatusEarlyHints)
	r.WriteHeader(http.StatusAccepted)
	r.WriteHeader(http.StatusTeapot)
	assert.Equal(t, http.StatusAccepted, r.finalStatus())
	n, err := r.Write([]byte("0123456789"))
	require.NoError(t, err)
	assert.Equal(t, 10, n)
	_, err = r.Write([]byte("x"))
	assert.ErrorIs(t, err, ErrResponseTooLarge)
	assert.True(t, r.overflow)
	r.Header().Add("Location", "/a")
	r.Header().Set("X-Other", strconv.Itoa(1))
	assert.Equal(t, http.Header{"Location": {"/a"}}, r.storedHeader([]string{"location", "etag"}))
}
