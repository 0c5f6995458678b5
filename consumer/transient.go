package consumer

import (
	"context"
	"errors"
	"io"
	"net"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// IsTransient reports whether err is an infrastructure failure that
// retrying the same message later can cure: the database unreachable, the
// connection lost, a server shutting down or out of resources, a
// serialization failure or deadlock, a timeout.
//
// The consumer never dead-letters or acks a message after such a failure
// of its own database work (begin, claim, commit); it rolls back, backs off
// and tries again (see Config.InfraBackoff). An error the handler returns
// counts as one only when it comes from the database: a connection that
// died under the transaction, or a PostgreSQL error whose class says
// "retry" (see above). Other errors, a failed HTTP call among them, are
// handler failures under the retry policy, so that a dependency that stays
// down ends in the dead-letter queue instead of blocking the stream.
func IsTransient(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return transientSQLState(pgErr.Code)
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
	var opErr *net.OpError
	if errors.As(err, &opErr) {
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
// (53), operator intervention such as admin shutdown (57P), system errors
// (58), serialization failure and deadlock (40001, 40P01), and read-only
// transactions after a failover (25006).
func transientSQLState(code string) bool {
	if len(code) < 2 {
		return false
	}
	switch code[:2] {
	case "08", "53", "58":
		return true
	}
	switch code {
	case "40001", "40P01", "57P01", "57P02", "57P03", "25006":
		return true
	}
	return false
}

// databaseFailure reports whether a handler's error is a failure of the
// database under tx rather than of the handler: the connection is gone, or
// the error is a transient PostgreSQL or driver error.
func databaseFailure(tx pgx.Tx, err error) bool {
	if tx.Conn().IsClosed() {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return transientSQLState(pgErr.Code)
	}
	var connectErr *pgconn.ConnectError
	return errors.As(err, &connectErr) || pgconn.SafeToRetry(err) || errors.Is(err, pgconn.ErrConnClosed)
}
