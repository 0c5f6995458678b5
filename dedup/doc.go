// Package dedup is the PostgreSQL store behind the consumer's exactly-once
// effects: the processed_events table, in which an event id is claimed in
// the same transaction as the handler's business writes, so that the row
// exists if and only if those writes committed.
//
// A Store is built from names (schema and table, validated and quoted, so
// configuration cannot inject SQL). Migrate brings its tables from any
// earlier schema version to SchemaVersion with numbered, embedded
// migrations, records the versions in once_schema_versions, refuses a newer
// schema (ErrSchemaNewer) unless the newer release recorded that this one
// runs on it (its steps only add) and checks the tables' shape (Check,
// ErrSchemaMismatch); MigrateTo goes down. The same migrations, with the
// default names, are in migrations/ for users of goose and
// migrations/golang-migrate/ for golang-migrate. Claim and ClaimBatch work inside a caller's pgx.Tx;
// QueueClaim and QueueClaimBatch queue the same statements on a pgx.Batch,
// so that a batch that begins the transaction (pgx.Batch.BeginTx) sends the
// BEGIN and the claim in one round trip.
// The attempts table (AttemptsTable) is created here but written by the
// consumer's crash guard alone. DeleteOlderThan applies one consumer's
// retention, to both tables, in bounded batches, paced by DutyCycle.
//
// A Store holds no connection and is safe for concurrent use.
package dedup
