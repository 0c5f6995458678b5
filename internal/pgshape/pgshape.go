package pgshape

import (
	"context"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
)

// Querier runs a query: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Want is a column a store reads or writes, its type as format_type names
// it.
type Want struct{ Name, Type string }

// Column is a column as the catalog describes it.
type Column struct {
	// Type as format_type names it.
	Type string
	// NotNull: the column refuses NULL.
	NotNull bool
	// Default: an insert that leaves the column out fills it (a default,
	// an identity or a generated column).
	Default bool
	// Folds: the column's collation is nondeterministic (it may take
	// distinct strings for one, e.g. case-insensitively).
	Folds bool
}

// Columns returns table's columns (table quoted, maybe qualified), or nil
// when it does not exist.
func Columns(ctx context.Context, q Querier, table string) (map[string]Column, error) {
	rows, err := q.Query(ctx, `SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), a.attnotnull,
	a.atthasdef OR a.attidentity <> '' OR a.attgenerated <> '', NOT coalesce(c.collisdeterministic, true)
FROM pg_attribute a LEFT JOIN pg_collation c ON c.oid = a.attcollation
WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped`, table)
	if err != nil {
		return nil, err
	}
	var (
		name string
		c    Column
		cols map[string]Column
	)
	_, err = pgx.ForEachRow(rows, []any{&name, &c.Type, &c.NotNull, &c.Default, &c.Folds}, func() error {
		if cols == nil {
			cols = map[string]Column{}
		}
		cols[name] = c
		return nil
	})
	return cols, err
}

// Diffs names what differs between have and want: missing columns, other
// types, and, sorted, the columns an insert by writer (a name for the
// message: "the store") cannot leave out (NOT NULL without a default)
// that want does not name.
func Diffs(have map[string]Column, want []Want, writer string) []string {
	var diffs []string
	needed := make(map[string]bool, len(want))
	for _, w := range want {
		needed[w.Name] = true
		h, ok := have[w.Name]
		switch {
		case !ok:
			diffs = append(diffs, fmt.Sprintf("column %s (%s) is missing", w.Name, w.Type))
		case h.Type != w.Type:
			diffs = append(diffs, fmt.Sprintf("column %s is %s, want %s", w.Name, h.Type, w.Type))
		}
	}
	var extra []string
	for name, h := range have {
		if !needed[name] && h.NotNull && !h.Default {
			extra = append(extra, name)
		}
	}
	slices.Sort(extra)
	for _, name := range extra {
		diffs = append(diffs, fmt.Sprintf("column %s is NOT NULL without a default, and %s does not write it", name, writer))
	}
	return diffs
}

// Cols returns the columns nameType names in pairs: a name, then its type,
// and so on. An odd count is a programming error: it panics.
func Cols(nameType ...string) []Want {
	if len(nameType)%2 != 0 {
		panic("pgshape.Cols: a name without its type")
	}
	cols := make([]Want, 0, len(nameType)/2)
	for i := 0; i < len(nameType); i += 2 {
		cols = append(cols, Want{Name: nameType[i], Type: nameType[i+1]})
	}
	return cols
}
