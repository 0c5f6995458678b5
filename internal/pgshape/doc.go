// Package pgshape reads a table's columns from PostgreSQL's catalog and
// names how they differ from the columns a store needs: the check dedup,
// outbox and idempotency run before they adopt a table of their name that
// someone else may have made.
package pgshape
