package oncetest

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// RequireEachOnce runs query, whose first column is a key (an event id, an
// order id: text, or anything fmt prints), and fails the test unless each
// of want appears in its rows exactly once and nothing else appears: each
// event's effect, exactly once.
func RequireEachOnce(t testing.TB, pool *pgxpool.Pool, query string, want ...string) {
	t.Helper()
	rows, err := pool.Query(context.Background(), query)
	if err != nil {
		t.Fatalf("oncetest: %s: %v", query, err)
	}
	defer rows.Close()
	seen := map[string]int{}
	for rows.Next() {
		values, err := rows.Values()
		if err != nil {
			t.Fatalf("oncetest: %s: %v", query, err)
		}
		if len(values) == 0 {
			t.Fatalf("oncetest: %s returns no column", query)
		}
		seen[fmt.Sprint(values[0])]++
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("oncetest: %s: %v", query, err)
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
	if len(problems) > 0 {
		slices.Sort(problems)
		t.Fatalf("oncetest: want each key once from %s: %v", query, problems)
	}
}
