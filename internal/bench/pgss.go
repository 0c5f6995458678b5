package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/internal/pgtemp"
)

// enableStatStatements loads pg_stat_statements into the throwaway server
// (a restart) so that a profiled run can say which statements took the
// database's time.
func enableStatStatements(ctx context.Context, srv *pgtemp.Server) error {
	conn, err := pgx.Connect(ctx, srv.URL())
	if err != nil {
		return err
	}
	_, err = conn.Exec(ctx, `ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'`)
	_ = conn.Close(ctx)
	if err != nil {
		return err
	}
	if err := srv.Stop(ctx); err != nil {
		return err
	}
	if err := srv.Restart(ctx); err != nil {
		return err
	}
	if conn, err = pgx.Connect(ctx, srv.URL()); err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`)
	return err
}

// resetStatStatements empties pg_stat_statements before a row; false when
// the extension is not there.
func resetStatStatements(ctx context.Context, db *pgxpool.Pool) bool {
	_, err := db.Exec(ctx, `SELECT pg_stat_statements_reset()`)
	return err == nil
}

// writeStatStatements writes the statements of the row just run, by total
// execution time, to <dir>/<broker>-<row>.pgss.txt.
func writeStatStatements(ctx context.Context, db *pgxpool.Pool, dir string, b Broker, row Row) error {
	rows, err := db.Query(ctx, `SELECT calls, total_exec_time, mean_exec_time, rows, shared_blks_hit, shared_blks_read,
       wal_bytes, regexp_replace(query, '\s+', ' ', 'g')
FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY total_exec_time DESC LIMIT 15`)
	if err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(dir, strings.ReplaceAll(string(b)+"-"+string(row), " ", "-")+".pgss.txt"))
	if err != nil {
		rows.Close()
		return err
	}
	defer f.Close()
	tw := tabwriter.NewWriter(f, 0, 0, 1, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "calls\t total ms\t mean ms\t rows\t blks hit\t blks read\t WAL MB\t query")
	var calls, nrows, hit, read int64
	var total, mean float64
	var wal float64
	var query string
	_, err = pgx.ForEachRow(rows, []any{&calls, &total, &mean, &nrows, &hit, &read, &wal, &query}, func() error {
		fmt.Fprintf(tw, "%d\t %.0f\t %.3f\t %d\t %d\t %d\t %.1f\t %s\n", calls, total, mean, nrows, hit, read, wal/(1<<20), truncate(query, 140))
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Flush()
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
