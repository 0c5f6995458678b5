// Package idempotency makes HTTP commands effectively once, with the same
// idea the consumer applies to events: the request's idempotency key is
// claimed in the PostgreSQL transaction in which the handler writes, and
// the response is stored in that transaction, so the effect and the record
// of it commit together or not at all.
//
// A Middleware wraps a net/http handler. The handler gets the request's
// transaction from Tx(r.Context()) and answers as usual; its response is
// buffered until the transaction has committed. The rules follow
// draft-ietf-httpapi-idempotency-key-header, and Stripe where the draft is
// silent:
//
//   - the key is the Idempotency-Key header (a Structured Field String, or
//     a bare value as Stripe's clients send it); missing on a route that
//     requires one: 400;
//   - a key seen before, with the same fingerprint (method, path, query,
//     body): the stored response, with Idempotent-Replayed: true (Stripe's
//     header); with another fingerprint: 422;
//   - a key whose first request is still running: 409, at once or after
//     Config.Wait;
//   - keys are scoped by Config.Scope, so clients cannot see each other's
//     responses, and by Config.Service, so that services keeping their
//     keys in one table do not answer each other's requests; they expire
//     after Config.TTL (24h);
//   - 5xx responses are not stored, and their writes are rolled back, so a
//     retry can succeed (Config.Store);
//   - the database unreachable or failing transiently, or no pool
//     connection within Config.AcquireTimeout (5s, beyond Config.Wait;
//     the handler had not started): 503 with Retry-After, and a retry
//     with the same key is served once; under pool pressure requests are
//     answered instead of held for as long as their clients wait;
//   - after a failover, a claim the demoted primary refuses as read-only
//     closes the pool's connections and is made once more on a new one.
//
// "In flight" needs no pending row: the claiming transaction holds a
// transaction-scoped advisory lock on the key until it commits or rolls
// back, so a second request with the key waits for the first (bounded by
// lock_timeout, then 409) and then sees the committed response or, if the
// first rolled back, claims the key itself. A process that dies
// mid-request leaves nothing behind: PostgreSQL rolls its transaction back,
// claim and lock included, when the connection drops.
//
// Migrate brings the table to its newest version from the numbered files
// in Migrations, recorded like the dedup store's versions;
// RunRetention (or DeleteExpired) removes expired keys in bounded batches.
// docs/http.md describes the guarantees and the tests behind them.
package idempotency
