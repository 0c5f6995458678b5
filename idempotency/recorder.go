package idempotency

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/onceco/once/internal/pgtext"
)

// ErrResponseTooLarge is returned by the response writer's Write when the
// handler's body exceeds Config.MaxResponseBytes. The middleware then rolls
// the transaction back and answers 500.
var ErrResponseTooLarge = errors.New("idempotency: response body exceeds MaxResponseBytes")

// recorder is the handler's http.ResponseWriter: it holds the status,
// headers and body until the transaction has committed (or not), because
// what the client sees must be what was stored.
type recorder struct {
	header   http.Header
	status   int
	body     bytes.Buffer
	limit    int
	overflow bool
}

func newRecorder(limit int) *recorder {
	return &recorder{header: make(http.Header), limit: limit}
}

// Header returns the headers the response will carry.
func (r *recorder) Header() http.Header { return r.header }

// WriteHeader records the first final status; informational (1xx)
// statuses cannot be held back and are dropped. A status net/http refuses
// (below 100 or above 999) panics as net/http's writer does, so that the
// request rolls back: taken for no status at all, it would commit the
// handler's writes and store a 200. A call after the final status (or
// the body) was written is superfluous and ignored whatever its code, as
// net/http ignores it before checking the code: the handler has answered.
func (r *recorder) WriteHeader(status int) {
	if r.status != 0 {
		return
	}
	if status < 100 || status > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", status))
	}
	if status >= 200 {
		r.status = status
	}
}

// Write buffers p, up to the limit.
func (r *recorder) Write(p []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	if r.body.Len()+len(p) > r.limit {
		r.overflow = true
		return 0, ErrResponseTooLarge
	}
	return r.body.Write(p)
}

// finalStatus is the status the response has: 200 when the handler wrote
// none, as net/http would send.
func (r *recorder) finalStatus() int {
	if r.status == 0 {
		return http.StatusOK
	}
	return r.status
}

// rawHeaderPrefix starts the name under which a stored header's values
// are kept base64-encoded: the headers are stored as JSON, whose strings
// cannot hold the bytes of a value that is not UTF-8 (HTTP allows obs-text,
// 0x80 to 0xFF), and PostgreSQL's jsonb cannot hold a NUL. No header name holds a ':', so no header can take it.
const rawHeaderPrefix = "once:base64:"

// storedHeader returns the headers among names that the response carries,
// in the form they are stored in (see rawHeaderPrefix).
func (r *recorder) storedHeader(names []string) http.Header {
	h := make(http.Header, len(names))
	for _, name := range names {
		name = http.CanonicalHeaderKey(name)
		v := headerValues(r.header, name)
		if len(v) == 0 {
			continue
		}
		if slices.IndexFunc(v, func(s string) bool { return !pgtext.Storable(s) }) < 0 {
			h[name] = v
			continue
		}
		raw := make([]string, len(v))
		for i, s := range v {
			raw[i] = base64.StdEncoding.EncodeToString([]byte(s))
		}
		h[rawHeaderPrefix+name] = raw
	}
	return h
}

// headerValues returns the values of the header canonical in h, those set
// under a name of another case too: a handler may write to the map
// directly (h["etag"]), and net/http sends such a name as it is.
func headerValues(h http.Header, canonical string) []string {
	var others []string
	for name := range h {
		if name != canonical && strings.EqualFold(name, canonical) {
			others = append(others, name)
		}
	}
	v := h[canonical]
	slices.Sort(others) // the same order at every replay
	for _, name := range others {
		v = append(slices.Clip(v), h[name]...)
	}
	return v
}

// loadedHeader returns the headers stored as h, decoded.
func loadedHeader(h http.Header) http.Header {
	out := make(http.Header, len(h)+1)
	for name, v := range h {
		plain, ok := strings.CutPrefix(name, rawHeaderPrefix)
		if !ok {
			out[name] = v
			continue
		}
		decoded := make([]string, 0, len(v))
		for _, s := range v {
			if b, err := base64.StdEncoding.DecodeString(s); err == nil {
				decoded = append(decoded, string(b))
			}
		}
		out[plain] = decoded
	}
	return out
}

// send writes a response to w.
func send(w http.ResponseWriter, header http.Header, status int, body []byte) {
	for k, v := range header {
		w.Header()[k] = v
	}
	w.WriteHeader(status)
	_, _ = w.Write(body) // the client went away: nothing to do
}
