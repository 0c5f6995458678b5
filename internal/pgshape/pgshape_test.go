package pgshape_test

import (
	"testing"

	"github.com/onceco/once/internal/pgshape"
)

// Diffs names a missing column, a column of another type and an extra
// column an insert cannot leave out, and nothing for a matching table.
func TestDiffs(t *testing.T) {
	want := []pgshape.Want{{"id", "text"}, {"n", "integer"}, {"at", "timestamp with time zone"}}
	same := map[string]pgshape.Column{"id": {Type: "text", NotNull: true}, "n": {Type: "integer"},
		"at": {Type: "timestamp with time zone"}, "note": {Type: "text", NotNull: true, Default: true}, "opt": {Type: "text"}}
	if d := pgshape.Diffs(same, want, "the store"); len(d) != 0 {
		t.Errorf("a matching table: %q", d)
	}
	other := map[string]pgshape.Column{"id": {Type: "character varying"}, "at": {Type: "timestamp with time zone"},
		"z": {Type: "text", NotNull: true}, "b": {Type: "text", NotNull: true}}
	got := pgshape.Diffs(other, want, "the store")
	wantDiffs := []string{
		"column id is character varying, want text",
		"column n (integer) is missing",
		"column b is NOT NULL without a default, and the store does not write it",
		"column z is NOT NULL without a default, and the store does not write it",
	}
	if len(got) != len(wantDiffs) {
		t.Fatalf("got %q, want %q", got, wantDiffs)
	}
	for i := range got {
		if got[i] != wantDiffs[i] {
			t.Errorf("diff %d: got %q, want %q", i, got[i], wantDiffs[i])
		}
	}
}

// Cols pairs names with their types, in order.
func TestCols(t *testing.T) {
	got := pgshape.Cols("id", "text", "n", "integer")
	if len(got) != 2 || got[0] != (pgshape.Want{Name: "id", Type: "text"}) || got[1] != (pgshape.Want{Name: "n", Type: "integer"}) {
		t.Errorf("got %v", got)
	}
}
