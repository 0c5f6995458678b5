package idempotency

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Config configures a Middleware. Only Scope is required.
type Config struct {
	// Scope names the client a request comes from, e.g. the authenticated
	// principal an earlier middleware put in the request's context. Keys
	// are unique per scope: two clients may use the same key, and neither
	// ever sees the other's stored response. Required; a service with a
	// single client (or keys unique across clients by construction) can
	// use SingleScope. It is called once per request that carries a key,
	// from the request's goroutine. Any string is a scope: one of at most
	// 2048 bytes of UTF-8 without NUL is stored as it is, any other (and
	// one that starts with "once:sha256:" or "once:service:") as
	// "once:sha256:" and the hex SHA-256 of its bytes, which PostgreSQL's
	// index rows and text hold. With a Service, the scope is stored behind
	// the service's name.
	Scope func(r *http.Request) string

	// Service names the service whose requests the middleware serves,
	// when several services keep their keys in one idempotency_keys
	// table (one schema, as they may share processed_events under their
	// consumer names): keys are unique per Service and Scope, so that a
	// client sending one key to two services (an order's id as the key
	// of both its creation and its payment) gets each service's own
	// answer. Services that share a table under the same Service (""
	// by default) share their keys: the second request gets the first's
	// response, or 422 when its fingerprint differs. A service with a
	// table of its own (a schema each) needs none. Changing it forgets
	// the keys stored under the old name: their retries run again.
	Service string

	// Schema holds the idempotency_keys table (see Migrate). Defaults to
	// "": the first schema of the connection's search_path.
	Schema string

	// Header is the request header that carries the key. Defaults to
	// "Idempotency-Key" (draft-ietf-httpapi-idempotency-key-header). New
	// refuses a name no request can carry (not an HTTP token).
	Header string

	// Optional lets requests without a key through: the handler runs in a
	// transaction like any other, but nothing is claimed or stored, and a
	// retry runs it again. By default a request without a key gets 400.
	Optional bool

	// Fingerprint summarises what a key may be reused for. A stored key
	// presented with a different fingerprint gets 422 and the handler does
	// not run. It gets the request and its whole body (which the handler
	// can still read). Defaults to DefaultFingerprint (method, path, query
	// and body); return nil to store none and never compare.
	Fingerprint func(r *http.Request, body []byte) []byte

	// Wait is how long a request waits while another request with the same
	// key is in flight (its transaction not yet ended) before it gets 409
	// Conflict. If the first commits within Wait, the waiting request gets
	// its response as a replay; if the first rolls back, the waiting one
	// runs. Defaults to 0: 409 at once, as the draft and Stripe answer.
	// At most about 24.8 days (PostgreSQL's longest lock_timeout). Every
	// waiting request holds a pool connection. A server statement_timeout
	// shorter than Wait ends the wait first, with 503.
	Wait time.Duration

	// AcquireTimeout bounds how long a request waits for a pool
	// connection and for the first round trip of its transaction (BEGIN
	// and the claim of its key), beyond Wait, the claim's own wait for
	// another request with the same key. Past it the request gets 503
	// with Retry-After (logged at Warn), so that under pool pressure a
	// request is answered instead of holding its goroutine and its client
	// for as long as the client waits; the handler never started, and a
	// retry with the same key is served once. It never cuts a handler
	// that runs. Defaults to DefaultAcquireTimeout (5s);
	// NoAcquireTimeout (-1) waits for as long as the request's context.
	// New refuses a value below a millisecond (a unit mistake: 5 is 5ns,
	// and every request would get 503) and one that overflows with Wait
	// added.
	AcquireTimeout time.Duration

	// TTL is how long a stored response is replayed, counted from when it
	// is stored (the end of its request, however long the request ran).
	// After it the key is free again: a request with it runs the handler.
	// Defaults to 24h; at least a millisecond.
	TTL time.Duration

	// Store decides by status code whether a response is stored. The
	// transaction commits exactly when the response is stored: an
	// unstored response rolls the handler's writes back too, so that a
	// retry can run again without doubling anything. Defaults to
	// DefaultStore: every status below 500.
	Store func(status int) bool

	// StoredHeaders are the response headers stored with the status and
	// body, and sent again on a replay. The first response carries every
	// header the handler set. Defaults to DefaultStoredHeaders.
	StoredHeaders []string

	// MaxRequestBytes bounds the request body read for the fingerprint; a
	// larger body gets 413. Defaults to 1 MiB.
	MaxRequestBytes int64

	// MaxResponseBytes bounds the response body the middleware buffers
	// (it must hold the whole response before the commit). A handler that
	// writes more gets ErrResponseTooLarge from Write, the transaction is
	// rolled back and the client gets 500. Defaults to 1 MiB.
	MaxResponseBytes int

	// TxOptions are the options of the request's transaction (isolation
	// level, deferrable). Defaults to PostgreSQL's: read committed. The
	// transaction writes the key's claim and its response, so it cannot
	// be read-only: New refuses AccessMode pgx.ReadOnly.
	TxOptions pgx.TxOptions

	// RetentionInterval is how often RunRetention deletes expired keys.
	// Defaults to 1h. New refuses a value below a millisecond (a unit
	// mistake: 60 is 60ns, and the sweeps would run back to back).
	RetentionInterval time.Duration

	// RetentionBatch is how many rows one retention statement deletes, so
	// that no statement holds locks for long. Defaults to 1000.
	RetentionBatch int

	// Logger receives infrastructure failures and handler misuse.
	// Defaults to slog.Default().
	Logger *slog.Logger
}

// Defaults of Config.
const (
	DefaultHeader           = "Idempotency-Key"
	DefaultTTL              = 24 * time.Hour
	DefaultMaxRequestBytes  = 1 << 20
	DefaultMaxResponseBytes = 1 << 20
	DefaultAcquireTimeout   = 5 * time.Second
	// NoAcquireTimeout is a Config.AcquireTimeout that lets a request
	// wait for a pool connection for as long as its context allows.
	NoAcquireTimeout time.Duration = -1
	// ReplayedHeader is set to "true" on a replayed response. The draft
	// names no such header; this is Stripe's.
	ReplayedHeader = "Idempotent-Replayed"
	// MaxKeyLength is the longest key accepted, in bytes (Stripe's limit).
	MaxKeyLength = 255
)

// DefaultStoredHeaders are the response headers stored when
// Config.StoredHeaders is nil: those that describe the representation or
// the created resource, not the exchange.
var DefaultStoredHeaders = []string{
	"Content-Type", "Content-Encoding", "Content-Language", "Content-Location", "Location", "ETag", "Last-Modified",
}

// ErrConfig is wrapped by New's errors for a configuration that cannot
// work.
var ErrConfig = errors.New("idempotency: invalid configuration")

// SingleScope is a Config.Scope for services whose keys need no separation
// by client: every request is in the scope "".
func SingleScope(*http.Request) string { return "" }

// DefaultStore stores every response below 500: a 4xx answer (a failed
// validation, a business rule) is the answer to that request and replays;
// a 5xx is rolled back so that a retry can succeed.
func DefaultStore(status int) bool { return status < 500 }

// DefaultFingerprint is the SHA-256 of the method, the escaped path, the
// raw query and the body: reusing a key for another endpoint, other
// parameters or another body is a 422.
func DefaultFingerprint(r *http.Request, body []byte) []byte {
	h := sha256.New()
	for _, part := range []string{r.Method, r.URL.EscapedPath(), r.URL.RawQuery} {
		h.Write([]byte(part))
		h.Write([]byte{0})
	}
	h.Write(body)
	return h.Sum(nil)
}

// validFieldName reports whether name is an HTTP field name: a token of
// RFC 9110 (visible ASCII but for the delimiters "(),/:;<=>?@[\]{}).
func validFieldName(name string) bool {
	if name == "" {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}

// maxWait is the longest Config.Wait: PostgreSQL's lock_timeout holds at
// most 2^31-1 milliseconds (about 24.8 days).
const maxWait = math.MaxInt32 * time.Millisecond

// withDefaults validates c and fills in its defaults.
func (c Config) withDefaults() (Config, error) {
	if c.Scope == nil {
		return c, fmt.Errorf("%w: Scope is required (use SingleScope for a single client)", ErrConfig)
	}
	if err := checkSchema(c.Schema); err != nil {
		return c, err
	}
	for _, f := range []struct {
		name string
		bad  bool
	}{
		{"Wait", c.Wait < 0}, {"TTL", c.TTL < 0}, {"MaxRequestBytes", c.MaxRequestBytes < 0},
		{"MaxResponseBytes", c.MaxResponseBytes < 0}, {"RetentionInterval", c.RetentionInterval < 0},
		{"RetentionBatch", c.RetentionBatch < 0},
	} {
		if f.bad {
			return c, fmt.Errorf("%w: %s must not be negative", ErrConfig, f.name)
		}
	}
	switch {
	case c.AcquireTimeout == 0:
		c.AcquireTimeout = DefaultAcquireTimeout
	case c.AcquireTimeout < 0 && c.AcquireTimeout != NoAcquireTimeout:
		return c, fmt.Errorf("%w: AcquireTimeout must not be negative (NoAcquireTimeout, -1, for no bound)", ErrConfig)
	}
	if c.TTL > 0 && c.TTL < time.Millisecond {
		// A unit mistake (TTL: 24 is 24ns): every response would expire as
		// it is stored.
		return c, fmt.Errorf("%w: TTL %v is below a millisecond (a time.Duration counts nanoseconds)", ErrConfig, c.TTL)
	}
	if c.Wait > maxWait {
		// Wait is PostgreSQL's lock_timeout, which refuses more.
		return c, fmt.Errorf("%w: Wait %v exceeds %v, the longest lock_timeout PostgreSQL accepts", ErrConfig, c.Wait, maxWait)
	}
	if c.AcquireTimeout > 0 && c.AcquireTimeout < time.Millisecond {
		// A unit mistake (AcquireTimeout: 5 is 5ns): no connection and
		// claim ever arrive in time, and every request would get 503.
		return c, fmt.Errorf("%w: AcquireTimeout %v is below a millisecond (a time.Duration counts nanoseconds)", ErrConfig, c.AcquireTimeout)
	}
	if c.AcquireTimeout > math.MaxInt64-c.Wait {
		// AcquireTimeout+Wait, the claim's deadline, would overflow into
		// one already past: every request would get 503.
		return c, fmt.Errorf("%w: AcquireTimeout %v plus Wait %v overflows a time.Duration (NoAcquireTimeout is no bound)", ErrConfig, c.AcquireTimeout, c.Wait)
	}
	if c.RetentionInterval > 0 && c.RetentionInterval < time.Millisecond {
		// A unit mistake (RetentionInterval: 60 is 60ns): RunRetention
		// would send its DELETE back to back, forever.
		return c, fmt.Errorf("%w: RetentionInterval %v is below a millisecond (a time.Duration counts nanoseconds)", ErrConfig, c.RetentionInterval)
	}
	if c.TxOptions.AccessMode == pgx.ReadOnly {
		return c, fmt.Errorf("%w: TxOptions.AccessMode is read only: the request's transaction writes the key's claim and response", ErrConfig)
	}
	if c.Header == "" {
		c.Header = DefaultHeader
	}
	if !validFieldName(c.Header) {
		// No request can carry it: every key would be missing.
		return c, fmt.Errorf("%w: Header %q is not an HTTP header name (RFC 9110 token), so no request can carry it", ErrConfig, c.Header)
	}
	c.Header = http.CanonicalHeaderKey(c.Header)
	if c.Fingerprint == nil {
		c.Fingerprint = DefaultFingerprint
	}
	if c.TTL == 0 {
		c.TTL = DefaultTTL
	}
	if c.Store == nil {
		c.Store = DefaultStore
	}
	if c.StoredHeaders == nil {
		c.StoredHeaders = DefaultStoredHeaders
	}
	if c.MaxRequestBytes == 0 {
		c.MaxRequestBytes = DefaultMaxRequestBytes
	}
	if c.MaxResponseBytes == 0 {
		c.MaxResponseBytes = DefaultMaxResponseBytes
	}
	if c.RetentionInterval == 0 {
		c.RetentionInterval = time.Hour
	}
	if c.RetentionBatch == 0 {
		c.RetentionBatch = 1000
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c, nil
}
