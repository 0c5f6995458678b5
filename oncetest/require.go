package oncetest

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// RequireEachOnce runs query, whose first column is a key (an event id, an
// order id), and fails the test unless each of want appears in its rows
// exactly once and nothing else appears: each event's effect, exactly
// once. Keys are compared as PostgreSQL writes them in text, as psql
// shows them: a uuid as 8c2f3d4e-…, an integer as 42, a numeric as 1.50, a
// boolean as t. A NULL key matches no want: it is an unexpected row. A
// key listed twice in want fails the test (each is wanted once). A query
// that has not answered within a minute (every connection of the pool held
// by rows never closed or a consumer left running, a lock it waits for)
// fails the test, saying so, rather than hang it.
func RequireEachOnce(t testing.TB, pool *pgxpool.Pool, query string, want ...string) {
	t.Helper()
	if pool == nil {
		t.Fatalf("oncetest: RequireEachOnce: nil pool")
	}
	wanted := make(map[string]bool, len(want))
	for _, k := range want {
		if wanted[k] {
			t.Fatalf("oncetest: RequireEachOnce: %q is listed twice in want (each key is wanted exactly once)", k)
		}
		wanted[k] = true
	}
	bound := requireTimeout
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	// In text, every type is read as PostgreSQL writes it, whatever Go
	// value pgx would decode it into (a uuid's is 16 bytes).
	rows, err := pool.Query(ctx, query, pgx.QueryResultFormats{pgx.TextFormatCode})
	if err != nil {
		t.Fatalf("oncetest: %s: %v%s", query, err, stuckHint(ctx, pool, bound))
	}
	defer rows.Close()
	seen := map[string]int{}
	nulls := 0
	for rows.Next() {
		values := rows.RawValues()
		if len(values) == 0 {
			t.Fatalf("oncetest: %s returns no column", query)
		}
		if values[0] == nil {
			nulls++
			continue
		}
		seen[string(values[0])]++
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("oncetest: %s: %v%s", query, err, stuckHint(ctx, pool, bound))
	}
	var problems []string
	for _, k := range want {
		if n := seen[k]; n != 1 {
			problems = append(problems, fmt.Sprintf("%q %d times", k, n))
		}
		delete(seen, k)
	}
	for k, n := range seen {
		problems = append(problems, fmt.Sprintf("unexpected %q %d times", k, n))
	}
	if nulls > 0 {
		problems = append(problems, fmt.Sprintf("unexpected NULL %d times", nulls))
	}
	if len(problems) > 0 {
		slices.Sort(problems)
		t.Fatalf("oncetest: want each key once from %s: %v", query, problems)
	}
}

// requireTimeout bounds RequireEachOnce's query. A variable for this
// package's tests only.
var requireTimeout = time.Minute

// stuckHint says why a query whose ctx (bounded by bound) ended may not
// have run: the pool's connections all held, or a lock; "" when ctx is
// live.
func stuckHint(ctx context.Context, pool *pgxpool.Pool, bound time.Duration) string {
	if ctx.Err() == nil {
		return ""
	}
	s := pool.Stat()
	return fmt.Sprintf(" (no answer within %v: %d of the pool's %d connections in use, by rows not closed or a consumer still running?, or the query waits for a lock)",
		bound, s.AcquiredConns(), s.MaxConns())
}
