package idempotency

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/isnil"
)

// Pool is what the middleware needs of a connection pool: *pgxpool.Pool
// satisfies it. SendBatch must hold one connection for the transaction a
// batch begins, until it ends. A Pool that also has a Reset method, as
// *pgxpool.Pool does, is reset when the server refuses a write as
// read-only (after a failover: see Handler).
type Pool interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Middleware runs HTTP handlers in a PostgreSQL transaction in which it
// also claims the request's idempotency key and stores the response. Build
// it with New; it is safe for concurrent use.
type Middleware struct {
	pool Pool
	cfg  Config
	sql  statements
}

// New validates cfg and returns a middleware whose transactions run on
// pool. It fails with an error wrapping ErrConfig for a nil pool (also a
// nil *pgxpool.Pool in the Pool), and with one wrapping ErrConfig (or
// ErrInvalidName for the schema) when cfg cannot work. It does not touch the database: run
// Migrate first.
func New(pool Pool, cfg Config) (*Middleware, error) {
	if isnil.Value(pool) {
		// Also a nil *pgxpool.Pool in the interface: a pool whose
		// constructor failed, its error dropped.
		return nil, fmt.Errorf("%w: the pool is nil", ErrConfig)
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	return &Middleware{pool: pool, cfg: cfg, sql: newStatements(cfg.Schema)}, nil
}

// finishTimeout bounds storing the response and committing. They run on a
// context detached from the request's: a client that gave up after the
// handler finished still gets its effect committed, and its retry a replay.
var finishTimeout = 30 * time.Second

// Handler wraps next, which must write its effects in Tx(r.Context()).
// For each request:
//
//   - no key: 400, or with Config.Optional the handler runs in a
//     transaction without a claim;
//   - a malformed key (empty, longer than MaxKeyLength, not printable
//     ASCII): 400; a body over MaxRequestBytes: 413;
//   - a key stored (not expired) for the request's scope: the stored
//     response, with Idempotent-Replayed: true, or 422 when the
//     fingerprint differs; the handler does not run;
//   - a key whose first request is still in flight: 409 after Config.Wait
//     (or the first's response, if it commits within Wait);
//   - a new key: the handler runs with the response buffered; a response
//     Config.Store accepts is stored and committed with the handler's
//     writes, then sent; any other response is sent after a rollback;
//   - an error (400 or more) the handler answered after the request's
//     context ended (the client gone, an outer middleware's deadline):
//     503 with Retry-After after a rollback, with or without a key: pgx
//     refuses a statement on an ended context without aborting the
//     transaction, so the answer may be the cancellation's, and the
//     writes before it half the effect;
//   - the database unreachable or failing transiently, a statement
//     canceled (statement_timeout), or no pool connection within
//     Config.AcquireTimeout: 503 with Retry-After, so that the client
//     retries with the same key;
//   - a claim the server refuses as read-only (25006: the pool's
//     connections reach a primary a failover demoted): the pool's
//     connections are closed (when the Pool has a Reset method, as
//     *pgxpool.Pool does) and the claim is made once more on a new
//     connection, before the handler runs; a server still read-only then
//     gets 503;
//   - with Config.Optional, a request without a key whose transaction
//     does not commit on a session the server reports read-only
//     (default_transaction_read_only or in_hot_standby, PostgreSQL 14 and
//     later): its handler's writes were refused, and the request gets
//     the handler's answer (or 500), but the pool's connections are
//     closed, so that the next requests reach the new primary.
//
// A panicking handler's transaction is rolled back and the panic goes on
// to net/http. The handler's response writer buffers: it is not an
// http.Flusher and cannot be hijacked.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(r.Header.Values(m.cfg.Header)) == 0 && m.cfg.Optional {
			m.serveWithoutKey(w, r, next)
			return
		}
		key, ok := m.requestKey(w, r)
		if !ok {
			return
		}
		body, ok := m.readBody(w, r)
		if !ok {
			return
		}
		m.serveWithKey(w, r, next, claim{
			scope: storedScope(m.cfg.Service, m.cfg.Scope(r)), key: key, fingerprint: m.cfg.Fingerprint(r, body),
			method: r.Method, path: storedPath(r.URL),
		})
	})
}

// requestKey returns the request's key. It answers 400 itself when the
// key is missing, repeated or malformed.
func (m *Middleware) requestKey(w http.ResponseWriter, r *http.Request) (string, bool) {
	values := r.Header.Values(m.cfg.Header)
	switch len(values) {
	case 0:
		problem(w, http.StatusBadRequest, "Idempotency-Key missing",
			"This operation requires an "+m.cfg.Header+" header: send a unique key, and the same key on every retry.")
		return "", false
	case 1:
	default:
		problem(w, http.StatusBadRequest, "Idempotency-Key invalid", "The request has more than one "+m.cfg.Header+" header.")
		return "", false
	}
	key, err := parseKey(values[0])
	if err != nil {
		problem(w, http.StatusBadRequest, "Idempotency-Key invalid", err.Error())
		return "", false
	}
	return key, true
}

// readBody reads the whole request body, up to MaxRequestBytes, and puts
// it back for the handler. It answers the request itself when it fails.
func (m *Middleware) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, true
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, m.cfg.MaxRequestBytes))
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		// The limit met may be one set in front of the middleware
		// (http.MaxBytesHandler), lower than MaxRequestBytes: the answer
		// names the one the body exceeded.
		problem(w, http.StatusRequestEntityTooLarge, "Request body too large",
			fmt.Sprintf("The body exceeds %d bytes.", tooLarge.Limit))
		return nil, false
	case err != nil:
		problem(w, http.StatusBadRequest, "Request body unreadable", err.Error())
		return nil, false
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	return body, true
}

// claim is one request's key and what is stored with it.
type claim struct {
	scope, key    string
	fingerprint   []byte
	method, path  string
	claimAttempts int
}

// stored is a committed row of a key.
type stored struct {
	fingerprint []byte
	status      int
	header      http.Header
	body        []byte
	expired     bool
}

// serveWithKey claims c and then replays, refuses or runs the handler.
func (m *Middleware) serveWithKey(w http.ResponseWriter, r *http.Request, next http.Handler, c claim) {
	ctx := r.Context()
	tx, won, prev, err := m.beginBounded(ctx, &c)
	if isSerializationFailure(err) {
		// Under repeatable read or serializable, a claim that waited for
		// the first request cannot see what it committed after this
		// transaction's snapshot: a new transaction sees the response.
		m.rollback(ctx, tx)
		c.claimAttempts = 0
		tx, won, prev, err = m.beginBounded(ctx, &c)
	}
	if m.leaveReadOnly(err) {
		// The claim, the transaction's first write, found the server
		// read-only: the pool's connections reach a primary a failover
		// demoted. Nothing ran; a new connection reaches the server the
		// connection string names now.
		if tx != nil {
			m.rollback(ctx, tx)
		}
		c.claimAttempts = 0
		tx, won, prev, err = m.beginBounded(ctx, &c)
	}
	tableTimeout := false
	if isLockTimeout(err) && !errors.Is(err, errAcquireTimeout) && !m.keyHeld(ctx, tx, c) {
		// No other transaction holds the key now, though the claim's wait
		// timed out: the request that held it ended since (a key in
		// flight, the usual case), or the timeout was the session's own,
		// waiting for the table. The claim made once more tells them
		// apart: it replays what the first committed, or runs when the
		// first rolled back, or times out again.
		c.claimAttempts = 0
		tx, won, prev, err = m.beginBounded(ctx, &c)
		tableTimeout = isLockTimeout(err) && !errors.Is(err, errAcquireTimeout) && !m.keyHeld(ctx, tx, c)
	}
	if tx != nil {
		defer m.rollback(ctx, tx) // a no-op after Commit
	}
	if m.acquireTimedOut(w, r, err) {
		return
	}
	if tableTimeout {
		// The session's own lock_timeout ended a wait for the table (a
		// DDL statement, a REINDEX) or for extending it twice, the key
		// free each time: no other request has the key.
		m.cfg.Logger.Warn("idempotency: the claim outlasted the session's lock_timeout waiting for the table",
			"path", r.URL.Path, "error", err)
		problem(w, http.StatusServiceUnavailable, "Service unavailable",
			"The request was not processed; retry with the same "+m.cfg.Header+".")
		return
	}
	switch {
	case isLockTimeout(err):
		problem(w, http.StatusConflict, "Request in progress",
			"A request with this "+m.cfg.Header+" is still being processed; retry later with the same key.")
		return
	case err != nil:
		m.infrastructureFailure(w, r, "claiming the key", err)
		return
	case !won:
		// The transaction only read: it ends before the answer, which a
		// slow client may take long to read, so that it holds no pool
		// connection meanwhile.
		m.rollback(ctx, tx)
		m.answerFromStore(w, r, c, prev)
		return
	}
	m.run(w, r, next, tx, &c)
}

// resetter is what the middleware asks of a pool whose connections reach a
// server turned read-only: *pgxpool.Pool's Reset, found by type assertion.
type resetter interface{ Reset() }

// leaveReadOnly closes the pool's connections when err is the server
// refusing a write as read-only (25006), and reports whether it did: after
// a failover, the connections the pool keeps may reach the demoted
// primary, now a standby, and would fail every request that draws one
// until the pool retires them (pgxpool.Config.MaxConnLifetime, an hour by
// default). The pool closes its idle connections at once and the others
// when they are released. A Pool without Reset is left as it is.
func (m *Middleware) leaveReadOnly(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "25006" {
		return false
	}
	r, ok := m.pool.(resetter)
	if !ok {
		return false
	}
	m.cfg.Logger.Warn("idempotency: the database refused a write as read-only (a failover?); closing the pool's connections", "error", err)
	r.Reset()
	return true
}

// readOnlySession reports whether tx's session is read-only by the
// server's word: default_transaction_read_only or in_hot_standby on, as
// PostgreSQL 14 and later report them to each session whenever they
// change (a failover's fencing, a reload, a promoted standby's
// demotion). It costs no round trip; an older server reports neither,
// and the answer is false.
func readOnlySession(tx pgx.Tx) bool {
	c := tx.Conn()
	if c == nil || c.PgConn() == nil {
		return false
	}
	pc := c.PgConn()
	return pc.ParameterStatus("default_transaction_read_only") == "on" || pc.ParameterStatus("in_hot_standby") == "on"
}

// leaveReadOnlySession closes the pool's connections after a request
// without a key whose transaction did not commit on a read-only session:
// its handler's writes were refused (25006) where no claim of the
// middleware's came first to see it, and every such request drawn on a
// connection to the demoted primary would fail so until the pool retired
// it. A Pool without Reset is left as it is.
func (m *Middleware) leaveReadOnlySession() {
	r, ok := m.pool.(resetter)
	if !ok {
		return
	}
	m.cfg.Logger.Warn("idempotency: a request's transaction failed on a read-only session (a failover?); closing the pool's connections")
	r.Reset()
}

// errAcquireTimeout is the cause of a request's first round trip cut by
// Config.AcquireTimeout.
var errAcquireTimeout = errors.New("idempotency: no pool connection and claim within Config.AcquireTimeout")

// acquireContext bounds the first round trip of a request's transaction
// (the wait for a pool connection, BEGIN and the claim) by
// Config.AcquireTimeout beyond Config.Wait; the handler's statements are
// not under it.
func (m *Middleware) acquireContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if m.cfg.AcquireTimeout < 0 {
		return ctx, func() {}
	}
	return context.WithTimeoutCause(ctx, m.cfg.AcquireTimeout+m.cfg.Wait, errAcquireTimeout)
}

// beginBounded is begin under acquireContext.
func (m *Middleware) beginBounded(ctx context.Context, c *claim) (pgx.Tx, bool, stored, error) {
	bctx, cancel := m.acquireContext(ctx)
	defer cancel()
	tx, won, prev, err := m.begin(bctx, c)
	if err != nil && ctx.Err() == nil && errors.Is(context.Cause(bctx), errAcquireTimeout) {
		err = fmt.Errorf("%w: %w", errAcquireTimeout, err)
	}
	return tx, won, prev, err
}

// acquireTimedOut answers 503 when err is a first round trip cut by
// Config.AcquireTimeout, and reports whether it did.
func (m *Middleware) acquireTimedOut(w http.ResponseWriter, r *http.Request, err error) bool {
	if !errors.Is(err, errAcquireTimeout) {
		return false
	}
	m.cfg.Logger.Warn("idempotency: no database connection within Config.AcquireTimeout (the pool is busy, or the database slow); answered 503",
		"path", r.URL.Path, "acquire_timeout", m.cfg.AcquireTimeout, "error", err)
	problem(w, http.StatusServiceUnavailable, "Service unavailable",
		"The request was not processed; retry with the same "+m.cfg.Header+".")
	return true
}

// begin sends BEGIN and the claim of c in one round trip, and, when the
// key was taken, reads the row that holds it. An expired row is deleted
// and the key claimed again, in the same transaction. won reports whether
// this transaction holds the claim; otherwise prev is the committed row.
// tx is returned, to be rolled back, even with an error.
func (m *Middleware) begin(ctx context.Context, c *claim) (tx pgx.Tx, won bool, prev stored, err error) {
	b := &pgx.Batch{}
	b.BeginTx(m.cfg.TxOptions)
	expired := false
	for {
		c.claimAttempts++
		if expired {
			b.Queue(m.sql.deleteExpired, c.scope, c.key)
		}
		b.Queue(m.sql.saveLockTimeout)
		b.Queue(m.sql.lockKey, c.scope, c.key, m.sql.lockNamespace, lockTimeoutSetting(m.cfg.Wait))
		b.Queue(m.sql.restoreLockTimeout)
		b.Queue(m.sql.claim, c.scope, c.key, c.fingerprint, c.method, c.path, m.cfg.TTL.Seconds()).
			Exec(func(tag pgconn.CommandTag) error { won = tag.RowsAffected() == 1; return nil })
		// The lookup rides along: it costs nothing when the claim won, and
		// saves a round trip on a replay. A new statement sees what the
		// transaction the lock waited for committed.
		found := false
		b.Queue(m.sql.lookup, c.scope, c.key).QueryRow(func(row pgx.Row) error {
			err := row.Scan(&prev.fingerprint, &prev.status, &prev.header, &prev.body, &prev.expired)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil
			}
			found = err == nil
			return err
		})
		var br pgx.BatchResults
		if tx == nil {
			br = m.pool.SendBatch(ctx, b)
			tx = br.Tx()
		} else {
			br = tx.SendBatch(ctx, b)
		}
		if err = br.Close(); err != nil || won {
			return tx, won, prev, err
		}
		if found && !prev.expired {
			return tx, false, prev, nil
		}
		if c.claimAttempts >= 3 {
			return tx, false, prev, errors.New("the key's row kept changing under the claim")
		}
		// Expired (delete it, then claim again; this transaction holds the
		// key's lock), or deleted by retention between the claim and the
		// lookup (claim again).
		b = &pgx.Batch{}
		expired = found
		prev = stored{}
	}
}

// keyHeld reports whether another transaction holds c's key, after tx,
// whose claim ended with a lock timeout, is rolled back (it may hold the
// key itself). When it cannot tell, it reports true: the answer is then
// 409, as for any timeout of the claim.
func (m *Middleware) keyHeld(ctx context.Context, tx pgx.Tx, c claim) bool {
	if tx != nil {
		m.rollback(ctx, tx)
	}
	held := true
	b := &pgx.Batch{}
	b.Queue(m.sql.keyHeld, c.scope, c.key, m.sql.lockNamespace).QueryRow(func(row pgx.Row) error {
		return row.Scan(&held)
	})
	bctx, cancel := m.acquireContext(ctx)
	defer cancel()
	if err := m.pool.SendBatch(bctx, b).Close(); err != nil {
		return true
	}
	return held
}

// answerFromStore answers a request whose key is stored: a replay, or 422
// for another fingerprint.
func (m *Middleware) answerFromStore(w http.ResponseWriter, r *http.Request, c claim, prev stored) {
	if prev.status == 0 {
		// Only the claiming transaction ever sees status 0; a committed 0
		// means something wrote the table behind the middleware's back.
		m.cfg.Logger.Error("idempotency: a committed key has no response", "scope", c.scope, "key", c.key)
		problem(w, http.StatusInternalServerError, "Stored response missing", "The key is stored without a response.")
		return
	}
	if c.fingerprint != nil && prev.fingerprint != nil && !bytes.Equal(c.fingerprint, prev.fingerprint) {
		problem(w, http.StatusUnprocessableEntity, "Idempotency-Key reused",
			"This "+m.cfg.Header+" was used for a different request; use a new key for a new request.")
		return
	}
	header := loadedHeader(prev.header)
	header.Set(ReplayedHeader, "true")
	send(w, header, prev.status, prev.body)
}

// run runs the handler in tx, which holds c's claim, then stores and
// commits, or rolls back, and answers.
func (m *Middleware) run(w http.ResponseWriter, r *http.Request, next http.Handler, tx pgx.Tx, c *claim) {
	rec := newRecorder(m.cfg.MaxResponseBytes)
	m.serveHandler(rec, r, next, tx, c)
	status := rec.finalStatus()
	endedBySQL := txEnded(tx)
	if endedBySQL {
		// COMMIT (a helper's conn.Begin and Commit on Tx(ctx).Conn())
		// made the claim, still without a response, and the writes before
		// it permanent; ROLLBACK took the claim. Whatever the status, the
		// response is stored below: a committed claim must not stay
		// without one (every retry would get 500 for the whole TTL), and
		// a claim that is gone gets the 500 below.
		m.cfg.Logger.Error("idempotency: the handler ended the request's transaction with SQL of its own (COMMIT or ROLLBACK)",
			"path", r.URL.Path, "status", status)
	}
	if rec.overflow && endedBySQL {
		// The body cannot be stored, but the claim must not stay without
		// a response: stored below is a 500 saying that the effect
		// committed (or, when the claim is gone, the 500 for that).
		m.cfg.Logger.Error("idempotency: response too large after the handler committed by SQL; a 500 is stored in its place",
			"path", r.URL.Path, "limit", m.cfg.MaxResponseBytes)
		rec = committedFailure("Response too large",
			"The request's effect was committed, but its response was too large to be stored; do not send it again as a new request.")
		status = rec.finalStatus()
	}
	switch {
	case rec.overflow:
		m.rollback(r.Context(), tx)
		m.cfg.Logger.Error("idempotency: response too large; rolled back", "path", r.URL.Path, "limit", m.cfg.MaxResponseBytes)
		problem(w, http.StatusInternalServerError, "Response too large", "The response could not be stored.")
		return
	case !m.cfg.Store(status) && !endedBySQL:
		// Rolled back before the answer, so that a retry it prompts finds
		// the key free: nothing happened, and the retry runs again.
		m.rollback(r.Context(), tx)
		send(w, rec.header, status, rec.body.Bytes())
		return
	case answeredAfterCancel(r, status) && !endedBySQL:
		m.rollback(r.Context(), tx)
		m.canceledMidHandler(w, r, status)
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), finishTimeout)
	defer cancel()
	// A body never written is nil, which pgx sends as NULL: the column
	// takes an empty body, not none (a 204 is stored like any response).
	body := rec.body.Bytes()
	if body == nil {
		body = []byte{}
	}
	tag, err := tx.Exec(ctx, m.sql.saveResponse, c.scope, c.key, status, rec.storedHeader(m.cfg.StoredHeaders), body, m.cfg.TTL.Seconds())
	if err == nil && tag.RowsAffected() != 1 {
		// The claim is gone: the handler ended the transaction with SQL
		// of its own (ROLLBACK; Rollback refuses), or deleted the key's
		// row. Nothing records the key, so the answer must not be a
		// success that a retry would run again.
		m.rollback(r.Context(), tx)
		m.cfg.Logger.Error("idempotency: the key's claim was gone when the response was to be stored: "+
			"the handler ended the request's transaction (ROLLBACK) or deleted the key's row; nothing records the key",
			"path", r.URL.Path, "status", status)
		problem(w, http.StatusInternalServerError, "Transaction ended by the handler",
			"The request's transaction ended before its response could be stored; its outcome is not recorded.")
		return
	}
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		m.notCommitted(w, r, rec, err)
		return
	}
	send(w, rec.header, status, rec.body.Bytes())
}

// serveHandler runs next in tx. A handler that panics (or calls
// runtime.Goexit) after committing the request's transaction by SQL has
// made its effect and the key's claim permanent, the claim still without a
// response: every retry would get 500 "Stored response missing" for the
// whole TTL. A response saying that the effect committed is stored first
// (the connection is outside a transaction: the UPDATE commits by itself),
// and the panic goes on to net/http.
func (m *Middleware) serveHandler(rec *recorder, r *http.Request, next http.Handler, tx pgx.Tx, c *claim) {
	returned := false
	defer func() {
		if !returned && txEnded(tx) {
			m.storeAbandoned(r, tx, c)
		}
	}()
	next.ServeHTTP(rec, m.withTx(r, tx, c.key))
	returned = true
}

// storeAbandoned stores, for a handler that committed the request's
// transaction by SQL and then never returned, a 500 that tells the retry
// its effect committed. A claim the handler's SQL rolled back is gone, and
// the UPDATE changes nothing: the retry runs the handler.
func (m *Middleware) storeAbandoned(r *http.Request, tx pgx.Tx, c *claim) {
	rec := committedFailure("Handler failed after committing",
		"The request's effect was committed, but the handler failed before answering; do not send it again as a new request.")
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), finishTimeout)
	defer cancel()
	tag, err := tx.Exec(ctx, m.sql.saveResponse, c.scope, c.key, rec.finalStatus(), rec.storedHeader(m.cfg.StoredHeaders),
		rec.body.Bytes(), m.cfg.TTL.Seconds())
	m.cfg.Logger.Error("idempotency: the handler ended the request's transaction with SQL of its own (COMMIT or ROLLBACK) and then panicked",
		"path", r.URL.Path, "stored", err == nil && tag.RowsAffected() == 1, "error", err)
}

// committedFailure is the 500 stored for a request whose handler
// committed its transaction by SQL but left no answer that can be stored.
// Its body, the middleware's own, is not held to MaxResponseBytes, which
// may be smaller.
func committedFailure(title, detail string) *recorder {
	rec := newRecorder(math.MaxInt)
	problem(rec, http.StatusInternalServerError, title, detail)
	return rec
}

// txEnded reports whether tx's connection is outside a transaction: the
// handler ended the request's transaction with SQL of its own.
func txEnded(tx pgx.Tx) bool {
	c := tx.Conn()
	return c != nil && c.PgConn() != nil && !c.PgConn().IsClosed() && c.PgConn().TxStatus() == 'I'
}

// notCommitted answers a request whose response could not be stored or
// committed.
func (m *Middleware) notCommitted(w http.ResponseWriter, r *http.Request, rec *recorder, err error) {
	status := rec.finalStatus()
	// An aborted transaction says so at the next statement (25P02: the
	// storing of a keyed response), or at the COMMIT itself, which pgx
	// answers with ErrTxCommitRollback (a request without a key under
	// Optional, where nothing of the middleware's runs before it).
	aborted := isAborted(err) || errors.Is(err, pgx.ErrTxCommitRollback)
	switch {
	case aborted && status >= 400:
		// The handler's statement failed and it answered with an error:
		// nothing committed, and that is what its answer says.
		send(w, rec.header, status, rec.body.Bytes())
	case aborted:
		m.cfg.Logger.Error("idempotency: the handler answered success after a statement of its transaction failed; rolled back",
			"path", r.URL.Path, "status", status)
		problem(w, http.StatusInternalServerError, "Transaction aborted",
			"A statement of the request's transaction failed; nothing was committed.")
	default:
		m.infrastructureFailure(w, r, "committing the response", err)
	}
}

// serveWithoutKey runs the handler in a transaction without a claim
// (Config.Optional): committed when Config.Store accepts the status.
func (m *Middleware) serveWithoutKey(w http.ResponseWriter, r *http.Request, next http.Handler) {
	ctx := r.Context()
	b := &pgx.Batch{}
	b.BeginTx(m.cfg.TxOptions) // the request's transaction, as with a key
	bctx, cancel := m.acquireContext(ctx)
	br := m.pool.SendBatch(bctx, b)
	tx := br.Tx()
	err := br.Close()
	if err != nil && ctx.Err() == nil && errors.Is(context.Cause(bctx), errAcquireTimeout) {
		err = fmt.Errorf("%w: %w", errAcquireTimeout, err)
	}
	cancel()
	if err != nil {
		if tx != nil {
			m.rollback(ctx, tx)
		}
		if !m.acquireTimedOut(w, r, err) {
			m.infrastructureFailure(w, r, "beginning the transaction", err)
		}
		return
	}
	defer m.rollback(ctx, tx) // a no-op after Commit
	rec := newRecorder(m.cfg.MaxResponseBytes)
	next.ServeHTTP(rec, m.withTx(r, tx, ""))
	// No claim of the middleware's meets a server turned read-only here:
	// the handler's own writes do, and fail the request. Its session says
	// so, and it is read now, while the connection is still the request's.
	readOnly := readOnlySession(tx)
	status := rec.finalStatus()
	if rec.overflow || !m.cfg.Store(status) {
		m.rollback(ctx, tx)
		if readOnly {
			m.leaveReadOnlySession()
		}
		if rec.overflow {
			problem(w, http.StatusInternalServerError, "Response too large", "The response could not be buffered.")
			return
		}
		send(w, rec.header, status, rec.body.Bytes())
		return
	}
	if answeredAfterCancel(r, status) {
		m.rollback(ctx, tx)
		if readOnly {
			m.leaveReadOnlySession()
		}
		m.canceledMidHandler(w, r, status)
		return
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
	defer cancel()
	if err := tx.Commit(cctx); err != nil {
		if readOnly {
			m.leaveReadOnlySession()
		}
		m.notCommitted(w, r, rec, err)
		return
	}
	send(w, rec.header, status, rec.body.Bytes())
}

// answeredAfterCancel reports whether the handler answered an error
// (status 400 or more) with the request's context ended: the client gone,
// or a deadline an outer middleware set passed. pgx refuses a statement
// on an ended context without sending it, which leaves the transaction
// unaborted: it may hold the writes of the statements before, and the
// answer may be the cancellation's ("context canceled" answered 400).
// Committed, it would be half an effect, and stored, the answer every
// retry gets for the TTL. A success is committed: the handler finished.
func answeredAfterCancel(r *http.Request, status int) bool {
	return status >= 400 && r.Context().Err() != nil
}

// canceledMidHandler answers a request rolled back by answeredAfterCancel:
// nothing was processed, and a retry with the key runs the handler whole.
func (m *Middleware) canceledMidHandler(w http.ResponseWriter, r *http.Request, status int) {
	m.cfg.Logger.Warn("idempotency: the handler answered an error after the request's context ended; rolled back, not stored",
		"path", r.URL.Path, "status", status, "error", context.Cause(r.Context()))
	problem(w, http.StatusServiceUnavailable, "Service unavailable",
		"The request was not processed; retry with the same "+m.cfg.Header+".")
}

// withTx returns r with the request's state in its context.
func (m *Middleware) withTx(r *http.Request, tx pgx.Tx, key string) *http.Request {
	return r.WithContext(context.WithValue(r.Context(), ctxKey{}, &requestState{tx: ownedTx{tx}, key: key}))
}

// rollback rolls tx back, also when the request's context ended, within
// finishTimeout: a database that stopped answering does not hold the
// request (and its connection) after its answer is known.
func (m *Middleware) rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
	defer cancel()
	_ = tx.Rollback(ctx) // a broken connection is discarded, which rolls back too
}

// infrastructureFailure answers 503 for a transient database failure or a
// canceled statement and 500 for anything else (a missing table: run
// Migrate), and logs it.
func (m *Middleware) infrastructureFailure(w http.ResponseWriter, r *http.Request, doing string, err error) {
	if r.Context().Err() != nil {
		// The request's context ended: the client is gone, or a deadline
		// an outer middleware set has passed and the client still waits.
		// Nothing is logged, but the request is answered: written nothing,
		// it would go out as an empty 200.
		problem(w, http.StatusServiceUnavailable, "Service unavailable",
			"The request was not processed (or its outcome is unknown); retry with the same "+m.cfg.Header+".")
		return
	}
	if consumer.IsTransient(err) || isQueryCanceled(err) {
		// A canceled statement (a server statement_timeout shorter than
		// Config.Wait, an operator's pg_cancel_backend) rolled the
		// request back: it was not processed, and a retry can succeed.
		m.cfg.Logger.Warn("idempotency: database unavailable", "doing", doing, "path", r.URL.Path, "error", err)
		problem(w, http.StatusServiceUnavailable, "Service unavailable",
			"The request was not processed (or its outcome is unknown); retry with the same "+m.cfg.Header+".")
		return
	}
	m.cfg.Logger.Error("idempotency: database failure", "doing", doing, "path", r.URL.Path, "error", err)
	problem(w, http.StatusInternalServerError, "Internal error",
		"The request was not processed; retrying with the same "+m.cfg.Header+" is safe.")
}

// RunRetention deletes expired keys every Config.RetentionInterval, in
// statements of Config.RetentionBatch rows, until ctx is done; it returns
// ctx's error. Failures are logged and retried at the next interval. Run
// it in one goroutine per service (more are harmless: the deletes do not
// conflict). Expired keys are treated as absent whether or not retention
// has removed them yet.
func (m *Middleware) RunRetention(ctx context.Context) error {
	t := time.NewTicker(m.cfg.RetentionInterval)
	defer t.Stop()
	for {
		n, err := m.DeleteExpired(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			m.cfg.Logger.Warn("idempotency: retention failed", "error", err)
			m.leaveReadOnly(err)
		case n > 0:
			m.cfg.Logger.Info("idempotency: retention removed expired keys", "rows", n)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// DeleteExpired deletes every expired key now, Config.RetentionBatch rows
// per statement (each its own short transaction), and returns how many it
// removed. It stops early with ctx's error. It waits for no other
// transaction: an expired key whose row another transaction holds (a
// request reusing the key, whose handler still runs; another sweep) is
// left for a later sweep, and a sweep that meets such rows may stop
// before the last batch.
func (m *Middleware) DeleteExpired(ctx context.Context) (int64, error) {
	return m.sql.deleteAllExpired(ctx, m.pool, m.cfg.RetentionBatch)
}
