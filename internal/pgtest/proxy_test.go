package pgtest

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// A pool behind the pretend pooler is told a process id that is not its
// server process's, and works as any other.
func TestPoolBehindPoolerIsToldAnotherProcessID(t *testing.T) {
	_, schema := Schema(t)
	pool, _ := NewPoolBehindPooler(t, schema, nil)
	ctx := context.Background()
	err := pool.AcquireFunc(ctx, func(conn *pgxpool.Conn) error {
		var server uint32
		if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&server); err != nil {
			return err
		}
		if told := conn.Conn().PgConn().PID(); told == server || told == 0 {
			t.Errorf("the connection was told process id %d, the server's is %d: want another", told, server)
		}
		var n int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM generate_series(1, 3)`).Scan(&n); err != nil || n != 3 {
			t.Errorf("a query behind the pooler: %d, %v", n, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
