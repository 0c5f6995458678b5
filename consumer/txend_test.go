package consumer

import "testing"

// mayEndTx finds every statement that may end a transaction, wherever it
// stands in the string, and is not misled by the words of literals,
// identifiers, comments and dollar-quoted bodies.
func TestMayEndTx(t *testing.T) {
	for sql, want := range map[string]bool{
		"COMMIT":                  true,
		"  commit and chain":      true,
		"END":                     true,
		"rollback":                true,
		"ABORT;":                  true,
		"PREPARE TRANSACTION 'x'": true,
		"COMMIT; BEGIN":           true,
		"INSERT INTO t VALUES (1); COMMIT; BEGIN":  true,
		"SELECT 1;END;START TRANSACTION":           true,
		"/* a ; comment */ END; BEGIN":             true,
		"/* nested /* ; */ COMMIT */ COMMIT":       true,
		"-- a comment\nCOMMIT":                     true,
		"SELECT 'it''s'; COMMIT":                   true,
		`SELECT E'\'; x'; COMMIT`:                  true,
		"SELECT $$ ; $$; ROLLBACK; BEGIN":          true,
		"ROLLBACK TO SAVEPOINT s":                  true, // watched; found not to end it
		"SELECT CASE WHEN $1 THEN 1 ELSE 2 END":    false,
		"INSERT INTO t VALUES ('; COMMIT')":        false,
		`SELECT E'\'; COMMIT'`:                     false,
		`SELECT "a;commit"`:                        false,
		"SELECT $tag$ ; COMMIT $tag$":              false,
		"SELECT 1 -- ; COMMIT":                     false,
		"SELECT 1 /* ; COMMIT */":                  false,
		"DO $$ BEGIN PERFORM 1; END $$":            false,
		"UPDATE t SET n = $1 WHERE id = $2":        false,
		"SELECT end_date FROM t; SELECT commit_id": false,
		"": false,
	} {
		if got := mayEndTx(sql); got != want {
			t.Errorf("mayEndTx(%q) = %v, want %v", sql, got, want)
		}
	}
	// It runs for every statement a handler sends: it allocates nothing.
	sql := "insert into effects (event_id, n) values ($1, $2) on conflict do nothing"
	if n := testing.AllocsPerRun(100, func() { mayEndTx(sql) }); n != 0 {
		t.Errorf("mayEndTx allocates %v times per call", n)
	}
}
