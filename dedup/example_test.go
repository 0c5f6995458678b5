package dedup_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/dedup"
)

// The claim goes in the same transaction as the handler's writes: the
// processed_events row commits if and only if the effects do, so a
// redelivered event is recognised and its effects are never applied twice.
func ExampleStore_Claim() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	store, err := dedup.New(dedup.Config{}) // table "processed_events" on the search_path
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx, pool); err != nil { // idempotent: run it on every start
		log.Fatal(err)
	}

	// One delivery, as a broker adapter would hand it over.
	payload := []byte(`{"order":"o-1","total":42}`)
	sum := sha256.Sum256(payload)
	claim := dedup.Claim{
		Consumer:    "order-processor",
		EventID:     "evt-0001",
		Fingerprint: sum[:],
		Source:      "orders",
		Partition:   0,
		Offset:      17,
	}

	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		res, err := store.Claim(ctx, tx, claim)
		if err != nil {
			return err // infrastructure error: do not ack; retry later
		}
		switch res.Outcome {
		case dedup.Duplicate:
			fmt.Println("already processed at", res.Previous.ProcessedAt)
			return nil // nothing to do: commit (a no-op) and ack
		case dedup.Conflict:
			// Same id, different payload: a producer bug worth a dead letter.
			return fmt.Errorf("event %s reused with another payload", claim.EventID)
		}
		// Claimed: the handler's business writes, in the same transaction.
		_, err = tx.Exec(ctx, `INSERT INTO orders (id, total) VALUES ($1, $2)`, "o-1", 42)
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	// Ack the delivery (or mark the Kafka offset) only now, after the commit.
}

// Start-up of a service that manages its schema with goose or
// golang-migrate (the files in dedup/migrations): Check fails, naming each
// difference, when the tables are missing or belong to something else;
// Version tells which migration the database is at.
func ExampleStore_Check() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, err := dedup.New(dedup.Config{})
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Check(ctx, pool); err != nil {
		log.Fatal(err) // wraps dedup.ErrSchemaMismatch: "column event_id (text) is missing; ..."
	}
	v, err := store.Version(ctx, pool)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("schema version %d of %d\n", v, dedup.SchemaVersion)
}

// Going back to an older release of the library: move the schema down with
// the newer one first. Migrate refuses a schema newer than it knows
// (dedup.ErrSchemaNewer).
func ExampleStore_MigrateTo() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, err := dedup.New(dedup.Config{})
	if err != nil {
		log.Fatal(err)
	}
	if err := store.MigrateTo(ctx, pool, 1); err != nil { // the schema of the release before versions were recorded
		log.Fatal(err)
	}
}
