package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/onceco/once/internal/pgshape"
)

// ErrSchemaMismatch is wrapped by Migrate's error when a table of the name
// exists with another shape than the middleware needs (another library's
// table, or one made by hand): the error names each difference.
var ErrSchemaMismatch = errors.New("idempotency: table has another shape")

// keyColumns are the columns the middleware writes or reads.
var keyColumns = pgshape.Cols(
	"scope", "text", "idempotency_key", "text", "fingerprint", "bytea", "method", "text", "path", "text",
	"status", "integer", "header", "jsonb", "body", "bytea", "expires_at", "timestamp with time zone",
)

// checkTable verifies that table (quoted, maybe qualified) has the columns
// the middleware needs, no other column an insert cannot leave out, a
// fingerprint that takes NULL (a Fingerprint may return nil), is
// logged (partitions included), and has a
// key that tells every (scope, idempotency_key) apart: a primary key or
// unique index on exactly those columns, valid, immediate and without a
// predicate, under deterministic collations. The claim's ON CONFLICT names
// that key; a key under a collation that folds case takes the scopes
// "Alice" and "alice" for one, and replays one client's responses to the
// other. It returns nil or an error wrapping ErrSchemaMismatch that names
// every difference.
func checkTable(ctx context.Context, tx pgx.Tx, table string) error {
	diffs, err := tableDiffs(ctx, tx, table)
	if err != nil {
		return fmt.Errorf("idempotency: checking %s: %w", table, err)
	}
	if len(diffs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s is not the table this library needs (another library's, or made by hand?): %s",
		ErrSchemaMismatch, table, strings.Join(diffs, "; "))
}

func tableDiffs(ctx context.Context, tx pgx.Tx, table string) ([]string, error) {
	have, err := pgshape.Columns(ctx, tx, table)
	if err != nil {
		return nil, err
	}
	if len(have) == 0 {
		return []string{"it does not exist, or has no columns"}, nil
	}
	diffs := pgshape.Diffs(have, keyColumns, "the middleware")
	for _, w := range keyColumns {
		h, ok := have[w.Name]
		if !ok {
			continue
		}
		switch w.Name {
		case "scope", "idempotency_key":
			if h.Folds {
				diffs = append(diffs, fmt.Sprintf("column %s has a nondeterministic collation: its lookups take distinct %ss for one", w.Name, w.Name))
			}
		case "fingerprint":
			// A Fingerprint that returns nil stores none: the claim
			// writes NULL.
			if h.NotNull {
				diffs = append(diffs, "column fingerprint is NOT NULL, and the claim writes NULL there under a Fingerprint that returns nil: every such claim would be refused")
			}
		case "status", "header", "body":
			// The claim leaves them to their defaults, and reads status.
			if !h.Default && (h.NotNull || w.Name == "status") {
				diffs = append(diffs, fmt.Sprintf("column %s has no default, and the claim does not write it", w.Name))
			}
		}
	}
	// Every row must outlive a crash: PostgreSQL empties an unlogged
	// table (or partition) when it recovers, and a standby has none of
	// its rows, so every stored key would be forgotten.
	var transient string
	if err := tx.QueryRow(ctx, `SELECT coalesce(string_agg(c.oid::regclass::text, ', ' ORDER BY c.oid::regclass::text), '')
FROM pg_class c WHERE (c.oid = to_regclass($1) OR c.oid IN (SELECT relid FROM pg_partition_tree(to_regclass($1))))
  AND c.relpersistence <> 'p'`,
		table).Scan(&transient); err != nil {
		return nil, err
	}
	if transient != "" {
		diffs = append(diffs, fmt.Sprintf("%s is unlogged (or temporary): PostgreSQL empties it when it recovers from a crash, "+
			"and a standby has none of its rows, so the stored keys would be forgotten and their requests run again", transient))
	}
	// The unique indexes: whether one is the key, and which take distinct
	// (scope, idempotency_key) for one or cannot arbitrate the claim.
	written := make([]string, len(keyColumns))
	for i, c := range keyColumns {
		written[i] = c.Name
	}
	var (
		key               bool
		folding, deferred []string
	)
	err = tx.QueryRow(ctx, `WITH ix AS (
	SELECT i.indexrelid AS oid, ic.relname::text AS name, i.indisvalid AND i.indimmediate AND i.indpred IS NULL AND i.indexprs IS NULL AS plain,
	       i.indimmediate AS immediate, i.indpred IS NULL AS total, k.*
	FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid,
	LATERAL (
		SELECT count(DISTINCT a.attname) FILTER (WHERE a.attname IN ('scope', 'idempotency_key')) AS key_cols,
		       count(*) AS cols,
		       bool_or(a.attname IN ('scope', 'idempotency_key') AND NOT coalesce(c.collisdeterministic, true)) AS folds,
		       coalesce(bool_and(a.attname = ANY($2::text[])), true) AS written
		FROM unnest(i.indkey::int2[], i.indcollation::oid[]) WITH ORDINALITY AS k(attnum, coll, ord)
		LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
		LEFT JOIN pg_collation c ON c.oid = k.coll
		WHERE k.ord <= i.indnkeyatts
	) k
	WHERE i.indrelid = to_regclass($1) AND i.indisunique
)
SELECT
	EXISTS (SELECT 1 FROM ix WHERE plain AND key_cols = 2 AND cols = 2 AND NOT folds),
	coalesce((SELECT array_agg(name ORDER BY name) FROM ix WHERE folds OR (key_cols < 2 AND written AND NOT EXISTS (
		-- the columns its expressions and predicate read
		SELECT 1 FROM pg_depend d JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
		WHERE d.classid = 'pg_class'::regclass AND d.objid = ix.oid AND d.refobjid = to_regclass($1)
		  AND d.refobjsubid > 0 AND a.attname <> ALL($2::text[])))), '{}'),
	coalesce((SELECT array_agg(name ORDER BY name) FROM ix WHERE NOT immediate AND total AND key_cols = 2 AND cols = 2), '{}')`,
		table, written).Scan(&key, &folding, &deferred)
	if err != nil {
		return nil, err
	}
	if !key {
		diffs = append(diffs, "no primary key or unique index on (scope, idempotency_key), valid, not deferrable, without a predicate and under deterministic collations: the claim's ON CONFLICT needs it")
	}
	for _, name := range folding {
		diffs = append(diffs, fmt.Sprintf("unique index %s takes distinct (scope, idempotency_key) for one: its key needs both columns, each under a deterministic collation", name))
	}
	for _, name := range deferred {
		diffs = append(diffs, fmt.Sprintf("unique index %s is deferrable: the claim's ON CONFLICT cannot use it", name))
	}
	return diffs, nil
}
