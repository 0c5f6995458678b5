package outbox

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/internal/pgtest"
)

// BenchmarkReadOutbox times one read of a batch of 100 by the relay, with
// 10,000 rows ready to publish: with nothing refused (the plain read, and
// the read that marks waiting rows, sent at most once a second), and with
// 100,000 rows of one key waiting behind its parked row ahead of them,
// before they are marked waiting (the cost of every read before schema
// version 2) and after.
//
//	go test ./outbox -run '^$' -bench BenchmarkReadOutbox -benchtime 50x
func BenchmarkReadOutbox(b *testing.B) {
	ctx := context.Background()
	pool, _ := pgtest.Schema(b)
	if err := Migrate(ctx, pool); err != nil {
		b.Fatal(err)
	}
	store, err := New(Config{})
	if err != nil {
		b.Fatal(err)
	}
	sql := newRelaySQL(store.table)
	var oid uint32
	if err := pool.QueryRow(ctx, `SELECT to_regclass('outbox')::oid`).Scan(&oid); err != nil {
		b.Fatal(err)
	}
	exec := func(b *testing.B, pool *pgxpool.Pool, query string) {
		rows, err := pool.Query(ctx, query, 100, int64(0), []int64{}, store.table, oid)
		if err != nil {
			b.Fatal(err)
		}
		n := 0
		for rows.Next() {
			n++
		}
		if rows.Err() != nil || n != 100 {
			b.Fatalf("read %d rows: %v", n, rows.Err())
		}
	}
	run := func(name, query string) {
		b.Run(name, func(b *testing.B) {
			for b.Loop() {
				exec(b, pool, query)
			}
		})
	}
	setup := func(sqls ...string) {
		for _, s := range sqls {
			if _, err := pool.Exec(ctx, s); err != nil {
				b.Fatal(err)
			}
		}
	}
	const ready = `INSERT INTO outbox (event_id, topic, key, body)
SELECT 'r' || g, 't', ('k' || (g % 1000))::bytea, 'x' FROM generate_series(1, 10000) g`
	setup(ready, `VACUUM ANALYZE outbox`)
	run("nothing refused/plain", sql.fetch)
	run("nothing refused/marking", sql.fetchMarking)

	setup(`DELETE FROM outbox`,
		`INSERT INTO outbox (event_id, topic, key, body, attempts, parked_at) VALUES ('p', 't', 'a', 'x', 3, now())`,
		`INSERT INTO outbox (event_id, topic, key, body) SELECT 'w' || g, 't', 'a', 'x' FROM generate_series(1, 100000) g`,
		ready, `VACUUM ANALYZE outbox`)
	run("100k waiting, not marked/plain", sql.fetch)
	for i := 0; i < 10; i++ { // 10,000 marked a read
		exec(b, pool, sql.fetchMarking)
	}
	var marked int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE waiting`).Scan(&marked); err != nil || marked != 100000 {
		b.Fatalf("%d rows marked waiting: %v", marked, err)
	}
	setup(`VACUUM ANALYZE outbox`)
	run("100k waiting, marked/plain", sql.fetch)
	run("100k waiting, marked/marking", sql.fetchMarking)
}
