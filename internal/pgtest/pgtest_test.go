package pgtest

import (
	"context"
	"testing"
)

func TestMain(m *testing.M) { Main(m) }

func TestSchemaIsolated(t *testing.T) {
	pool, schema := Schema(t)
	var got string
	if err := pool.QueryRow(context.Background(), "SELECT current_schema()").Scan(&got); err != nil {
		t.Fatal(err)
	}
	if got != schema {
		t.Fatalf("current_schema = %q, want %q", got, schema)
	}
}
