package idempotency

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
)

// ErrTxOwned is returned by Commit and Rollback of the transaction a
// handler gets from Tx: the middleware ends it, after storing the response.
var ErrTxOwned = errors.New("idempotency: the middleware commits or rolls back the request's transaction")

type ctxKey struct{}

// requestState is what the middleware puts in a request's context.
type requestState struct {
	tx  pgx.Tx
	key string
}

// Tx returns the transaction of a request that went through the
// middleware, or nil for any other context. The handler writes its effects
// in it; the middleware claims the key in it and commits it, with the
// response, after the handler returns (or rolls it back: see
// Config.Store). Its Commit and Rollback return ErrTxOwned; a handler
// that ends it with SQL of its own (ROLLBACK) loses the key's claim, and
// its response is replaced by a 500, since nothing records it; one that
// commits it by SQL (a helper's Begin and Commit on Tx(ctx).Conn()) has
// its response stored whatever its status, since its effect is (a 500
// saying so when it then panics). Use it from
// the handler's goroutine only, and only until the handler returns: a
// pgx.Tx is not safe for concurrent use.
func Tx(ctx context.Context) pgx.Tx {
	if s, ok := ctx.Value(ctxKey{}).(*requestState); ok {
		return s.tx
	}
	return nil
}

// Key returns the idempotency key of a request that went through the
// middleware, or "" when it had none (Config.Optional) or did not go
// through it. Keys are unique per Config.Service and Config.Scope only: a
// handler may use the key, with the request's scope, as the id of what it
// creates; the key alone names another client's resource as well.
func Key(ctx context.Context) string {
	if s, ok := ctx.Value(ctxKey{}).(*requestState); ok {
		return s.key
	}
	return ""
}

// ownedTx is the request's transaction as handlers see it: everything but
// ending it.
type ownedTx struct{ pgx.Tx }

// Commit refuses: the middleware commits, after storing the response.
func (ownedTx) Commit(context.Context) error { return ErrTxOwned }

// Rollback refuses: respond with a status Config.Store does not store
// (5xx by default) to roll the request's writes back.
func (ownedTx) Rollback(context.Context) error { return ErrTxOwned }
