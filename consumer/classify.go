package consumer

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"
)

// ErrorClass says what a failure is, and so what the consumer does next.
type ErrorClass int

const (
	// ClassInfrastructure means the database (or the broker) failed, not
	// the message. The transaction is rolled back and the message tried again
	// after Config.InfraBackoff, without bound: it is never acked and never
	// dead-lettered for it.
	ClassInfrastructure ErrorClass = iota + 1
	// ClassRetry means the handler failed. The message is tried again per
	// Config.Retry, then dead-lettered with kind KindHandler (KindPanic for
	// a panic).
	ClassRetry
	// ClassPermanent means retrying cannot help. The message is dead-lettered
	// at once.
	ClassPermanent
)

// String returns the class's name: "infrastructure", "retry" or
// "permanent", and "unknown" for a value that names no class.
func (c ErrorClass) String() string {
	switch c {
	case ClassInfrastructure:
		return "infrastructure"
	case ClassRetry:
		return "retry"
	case ClassPermanent:
		return "permanent"
	}
	return "unknown"
}

// Classify returns the default class of an error met while handling a
// message (the handler's own error, the failure of a statement it queued,
// or the failure of the commit):
//
//   - Permanent's error: ClassPermanent.
//   - A DecodeError (a handler that decodes a payload of its own and
//     failed), unless RetryAfter wraps it: ClassPermanent, dead-lettered
//     with kind KindDecode: the same bytes fail the same way on every run.
//   - RetryAfter's error: ClassRetry, whatever it wraps (a deadlock or a
//     serialization failure among them): the handler asked for its next
//     attempt after a delay, counted against Config.Retry.MaxAttempts.
//   - A PostgreSQL error whose SQLSTATE says retrying the same work can
//     succeed: connection exceptions (08), insufficient resources (53, but
//     for 53400: a statement whose temporary files exceed temp_file_limit
//     exceeds it on every retry),
//     operator intervention such as an administrator shutdown (57P01-03),
//     a session ended for idling past idle_session_timeout (57P05),
//     system errors (58), serialization failure (40001), deadlock (40P01),
//     a lock another transaction held past lock_timeout, or at a NOWAIT
//     (55P03), a read-only transaction after a failover (25006; the
//     consumer then resets its pool, whose connections may reach a server
//     that is read-only now), a statement whose cached plan a schema
//     change made stale (0A000 "cached plan must not change result type",
//     met once on each pooled connection after, say, a column's type
//     changed; the consumer then closes the connection that met it):
//     ClassInfrastructure.
//   - Any other PostgreSQL error, among them integrity violations (23, also
//     a deferred constraint that fails at COMMIT), data exceptions (22),
//     syntax errors and undefined objects (42), a statement_timeout
//     (57014): ClassRetry. Retrying the same transaction meets the same
//     error, so the message ends in the dead-letter queue with the SQLSTATE
//     in its HeaderErrorSQLState header instead of blocking its stream.
//     (The consumer takes a handler's 57014, or that of a statement it
//     queued, for infrastructure when the statement it canceled was
//     waiting for another session's lock, as it last saw it: the sessions'
//     statement_timeout, read at start, is watched like HandlerTimeout.)
//   - A connection to PostgreSQL that could not be opened or was lost:
//     ClassInfrastructure.
//   - A context deadline or cancellation: ClassRetry. The consumer's own
//     contexts (shutdown, a revoked partition) never reach Classify, and
//     Config.HandlerTimeout is a handler failure (infrastructure when it
//     cut a statement waiting for another session's lock; see
//     Config.HandlerTimeout); so this is a deadline the handler put on a
//     call of its own.
//   - Anything else, a failed HTTP call among them: ClassRetry, so that a
//     dependency that stays down ends in the dead-letter queue.
//
// A full lock table (53200 "out of shared memory", its hint naming
// max_locks_per_transaction or max_pred_locks_per_transaction) met by a
// message run alone after another such run is charged to the message
// whatever its class: its handler alone overflows the server's lock table,
// and would on every retry. Any other 53200, the server out of memory,
// stays infrastructure however often it comes.
//
// A handler's error is also taken for infrastructure when the connection
// of its transaction died under it. Config.Retry.Classify can override any
// of this.
func Classify(err error) ErrorClass {
	var perm *PermanentError
	var decode *DecodeError
	var retryAfter *RetryAfterError
	var pgErr *pgconn.PgError
	var connectErr *pgconn.ConnectError
	switch {
	case err == nil:
		return ClassRetry
	case errors.As(err, &perm):
		return ClassPermanent
	case errors.As(err, &retryAfter):
		// Before DecodeError: a handler that asks for a later run of
		// what it could not decode (a schema not known yet) gets it.
		return ClassRetry
	case errors.As(err, &decode):
		return ClassPermanent
	case errors.As(err, &pgErr):
		if transientSQLState(pgErr.Code) || staleCachedPlan(pgErr) {
			return ClassInfrastructure
		}
		return ClassRetry
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return ClassRetry
	case errors.As(err, &connectErr), errors.Is(err, pgconn.ErrConnClosed):
		return ClassInfrastructure
	}
	return ClassRetry
}

// IsTransient reports whether err is an infrastructure failure that
// retrying the same work later can cure: the database unreachable, the
// connection lost, a server shutting down or out of resources, a
// serialization failure or deadlock, a lock another transaction held (past
// lock_timeout, or at a NOWAIT), a cached plan a schema change made stale,
// a network error or a timeout. It
// judges the error alone; Classify is what the consumer applies to a
// handler's error.
func IsTransient(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return transientSQLState(pgErr.Code) || staleCachedPlan(pgErr)
	}
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) {
		return true
	}
	if pgconn.Timeout(err) || pgconn.SafeToRetry(err) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	switch {
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET),
		errors.Is(err, syscall.EPIPE), errors.Is(err, net.ErrClosed):
		return true
	}
	return errors.Is(err, pgconn.ErrConnClosed)
}

// transientSQLState: connection exceptions (08), insufficient resources
// (53, but for 53400, a statement's temporary files past temp_file_limit),
// system errors (58), serialization failure and deadlock (40001,
// 40P01), a lock not available (55P03: lock_timeout, NOWAIT), administrator
// or crash shutdown and cannot-connect-now (57P01-03), a session the server
// ended for idling past idle_session_timeout (57P05), and read-only
// transactions after a failover (25006).
func transientSQLState(code string) bool {
	if len(code) < 2 {
		return false
	}
	if code == "53400" {
		// configuration_limit_exceeded: in a transaction, a statement's
		// temporary files past temp_file_limit. The statement exceeds it
		// on its own, and would again on every retry.
		return false
	}
	switch code[:2] {
	case "08", "53", "58":
		return true
	}
	switch code {
	case "40001", "40P01", "55P03", "57P01", "57P02", "57P03", "57P05", "25006":
		return true
	}
	return false
}

// staleCachedPlan reports whether e is PostgreSQL refusing to run a
// prepared statement whose result type a schema change altered (a column's
// type changed, a view or SELECT * over a table whose columns changed):
// 0A000 from RevalidateCachedQuery, "cached plan must not change result
// type". Each connection that prepared the statement meets it once: pgx
// then drops the statement from the connection's cache and prepares it
// anew on the next try. Other 0A000 errors (a feature the statement
// itself asks for) are the statement's own. The routine is asked first
// because the message follows the server's lc_messages.
func staleCachedPlan(e *pgconn.PgError) bool {
	return e.Code == "0A000" &&
		(e.Routine == "RevalidateCachedQuery" || e.Message == "cached plan must not change result type")
}

// sqlState returns the SQLSTATE of err, or "" when err is not a
// PostgreSQL error.
func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// databaseRefused reports whether err is PostgreSQL refusing the
// consumer's role what it needs: its authentication (SQLSTATE class 28) or
// a privilege (42501).
func databaseRefused(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (strings.HasPrefix(pe.Code, "28") || pe.Code == "42501")
}
