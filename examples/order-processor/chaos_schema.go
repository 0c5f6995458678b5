package main

import (
	"context"
	"fmt"
	"time"
)

// faultSchemaChange is the fault that changes the type of a column the
// handlers read while the members run, as a routine migration does:
// orders.status goes from text to varchar(20), and at the next such fault
// back. Each member's pooled connection that prepared the handlers' read of
// the order (lockOrder) then meets its cached plan refused once ("cached
// plan must not change result type"), which the consumer must retry as
// infrastructure rather than count against the message's attempts and
// dead-letter a valid event.
const faultSchemaChange = "schema-change"

// schemaFaults are the run's schema changes.
func (r *chaosRun) schemaFaults() []fault {
	fs := make([]fault, 0, r.cfg.SchemaChanges)
	for range r.cfg.SchemaChanges {
		fs = append(fs, fault{kind: faultSchemaChange})
	}
	return fs
}

// changeColumnType changes orders.status to the other of its two types.
// The ALTER waits for the transactions that hold the orders' rows and
// holds up the next ones for as long as it runs: a table of a few thousand
// rows is checked in milliseconds.
func (r *chaosRun) changeColumnType(ctx context.Context) error {
	r.schemaChanges++
	typ := "varchar(20)"
	if r.schemaChanges%2 == 0 {
		typ = "text"
	}
	qctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := r.pool.Exec(qctx, `ALTER TABLE orders ALTER COLUMN status TYPE `+typ); err != nil {
		return fmt.Errorf("change the type of orders.status to %s: %w", typ, err)
	}
	r.logf("orders.status is %s now", typ)
	return nil
}
