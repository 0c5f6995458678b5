// Package pgtext tells which Go strings PostgreSQL's text type can hold:
// the check dedup, outbox, idempotency and consumer run on what they store,
// so that a value the database would refuse (with SQLSTATE 22021, which
// reads as an outage) is refused before any statement, as the caller's
// fault.
package pgtext
