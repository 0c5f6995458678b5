package bench

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/dedup"
)

// pgbenchSchema holds the tables of the database ceiling.
const pgbenchSchema = "oncebench_pgbench"

// pgbenchScript is one transaction of a batched consumer, as the library
// issues it: claim BATCH new ids with one INSERT ... SELECT ... ON CONFLICT
// DO NOTHING RETURNING (with a 32-byte fingerprint, source, partition and
// offset, like dedup's batch claim), write BATCH business rows with one
// multi-row INSERT, commit.
const pgbenchScript = `\set base random(1, 1000000000000)
BEGIN;
INSERT INTO processed_events (consumer, event_id, fingerprint, source, partition, "offset")
  SELECT 'pgbench', :client_id || '-' || :base || '-' || g, sha256(g::text::bytea), 'bench', :client_id, g
  FROM generate_series(1, :batch) AS g
  ON CONFLICT DO NOTHING RETURNING event_id;
INSERT INTO effects (event_id, n, account, amount)
  SELECT :client_id || '-' || :base || '-' || g, g, 'acct-' || (g % 64), 100 + g
  FROM generate_series(1, :batch) AS g;
COMMIT;
`

// pgbenchBinary finds pgbench: the newest /usr/lib/postgresql/*/bin, else
// PATH.
func pgbenchBinary() (string, error) {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pgbench")
	sort.Slice(dirs, func(i, j int) bool {
		vi, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(dirs[i]))))
		vj, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(dirs[j]))))
		return vi > vj
	})
	if len(dirs) > 0 {
		return dirs[0], nil
	}
	return exec.LookPath("pgbench")
}

var tpsLine = regexp.MustCompile(`tps = ([0-9.]+) \(without initial connection time\)`)

// runPGBench measures the database alone: pgbench runs the claim and the
// business insert of a batch per transaction, from as many clients as
// there are partitions, against the same server.
func runPGBench(ctx context.Context, db *pgxpool.Pool, o Options, rep *Report) error {
	bin, err := pgbenchBinary()
	if err != nil {
		return fmt.Errorf("pgbench not found (Debian's postgresql package has it): %w", err)
	}
	if err := createSchema(ctx, db, pgbenchSchema); err != nil {
		return err
	}
	defer dropSchema(db, pgbenchSchema)
	store, err := dedup.New(dedup.Config{Schema: pgbenchSchema})
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx, db); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "oncebench-pgbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	script := filepath.Join(dir, "claim.sql")
	if err := os.WriteFile(script, []byte(pgbenchScript), 0o644); err != nil {
		return err
	}
	cfg, err := pgxpool.ParseConfig(o.DatabaseURL)
	if err != nil {
		return err
	}
	clients := max(1, o.Workload.Partitions)
	args := []string{"-n", "-T", strconv.Itoa(max(1, int(o.PGBench/time.Second))), "-c", strconv.Itoa(clients),
		"-j", strconv.Itoa(min(clients, 2)), "-D", "batch=" + strconv.Itoa(o.BatchSize), "-f", script}
	cmd := exec.CommandContext(ctx, bin, args...)
	cc := cfg.ConnConfig
	cmd.Env = append(os.Environ(), "PGHOST="+cc.Host, "PGPORT="+strconv.Itoa(int(cc.Port)), "PGUSER="+cc.User,
		"PGPASSWORD="+cc.Password, "PGDATABASE="+cc.Database, "PGOPTIONS=-c search_path="+pgbenchSchema)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("pgbench: %w: %s", err, out.String())
	}
	m := tpsLine.FindStringSubmatch(out.String())
	if m == nil {
		return fmt.Errorf("pgbench: no tps in its output: %s", out.String())
	}
	tps, _ := strconv.ParseFloat(m[1], 64)
	rep.PGBenchTPS = tps
	rep.PGBench = tps * float64(o.BatchSize)
	rep.PGBenchArgs = "pgbench " + strings.Join(args[:len(args)-1], " ") + " claim.sql"
	return nil
}
