package inspect

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtext"
)

// Tables names the store's tables, as dedup.Config does.
type Tables struct {
	// Schema holds the tables; "" resolves them through the search_path.
	Schema string
	// Table is the processed-events table; "" means dedup.DefaultTable.
	// The attempts table is Table + "_attempts".
	Table string
}

var identifier = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,47}$`)

// ErrInvalidName is returned for a schema or table name that is not a
// plain SQL identifier.
var ErrInvalidName = errors.New("inspect: invalid identifier")

func (t Tables) names() (processed, attempts string, err error) {
	table := t.Table
	if table == "" {
		table = dedup.DefaultTable
	}
	if !identifier.MatchString(table) {
		return "", "", fmt.Errorf("%w: table %q", ErrInvalidName, table)
	}
	if t.Schema != "" && !identifier.MatchString(t.Schema) {
		return "", "", fmt.Errorf("%w: schema %q", ErrInvalidName, t.Schema)
	}
	// Quoted as dedup quotes them: unquoted, PostgreSQL would fold a name
	// with capitals to lower case (another table) and refuse a reserved
	// word.
	qualify := func(name string) string {
		if t.Schema == "" {
			return pgx.Identifier{name}.Sanitize()
		}
		return pgx.Identifier{t.Schema, name}.Sanitize()
	}
	return qualify(table), qualify(table + "_attempts"), nil
}

// tablesHint returns err saying what makes the tables when it is
// PostgreSQL's undefined table (42P01): a database no consumer has run
// on, or a schema or table name that is not the store's. The bare
// "relation does not exist" names no way out.
func tablesHint(err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "42P01" {
		return fmt.Errorf("%w (once migrate creates the tables, as a consumer's start does; or the schema and table named are not the store's)", err)
	}
	return err
}

// DB is what the queries need: *pgxpool.Pool, *pgx.Conn and pgx.Tx have it.
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Consumer is what the database knows of one consumer name.
type Consumer struct {
	Name string `json:"name"`
	// Processed is the number of processed-event rows: events handled (or
	// recorded as skipped) and not yet removed by retention.
	Processed int64 `json:"processed"`
	// Oldest and Newest are the processed_at bounds of those rows.
	Oldest time.Time `json:"oldest,omitzero"`
	Newest time.Time `json:"newest,omitzero"`
	// InFlight counts attempt rows: messages that may be redeliveries and
	// are being handled, or whose handling a process did not survive.
	InFlight int64 `json:"in_flight"`
	// CrashSuspects counts attempt rows not seen for longer than the
	// suspect age given to Consumers, or charged more than one crash: a
	// process died with the message in flight. Past the consumer's
	// CrashGuard.MaxCrashes such a message is dead-lettered as crash-loop.
	CrashSuspects int64 `json:"crash_suspects"`
	// MaxAttempts is the highest run count of those rows: the handler's
	// runs, those that failed included.
	MaxAttempts int `json:"max_attempts"`
}

// Consumers returns every consumer name found in the tables, sorted by
// name. Attempt rows older than suspectAge, or with more than one crash,
// are counted as crash suspects; a negative suspectAge is an error. It
// reads the whole processed-events table (one aggregate), so it costs a
// scan on a large table.
func Consumers(ctx context.Context, db DB, t Tables, suspectAge time.Duration) ([]Consumer, error) {
	processed, attempts, err := t.names()
	if err != nil {
		return nil, err
	}
	if suspectAge < 0 {
		return nil, fmt.Errorf("inspect: suspect age %v is negative", suspectAge)
	}
	crashed, err := crashesCounted(ctx, db, attempts)
	if err != nil {
		return nil, fmt.Errorf("inspect: read %s: %w", attempts, err)
	}
	sql := `
WITH p AS (
    SELECT consumer, count(*) AS n, min(processed_at) AS oldest, max(processed_at) AS newest
    FROM ` + processed + ` GROUP BY consumer
), a AS (
    SELECT consumer, count(*) AS n,
           count(*) FILTER (WHERE ` + crashed + ` OR last_seen < now() - make_interval(secs => $1)) AS suspects,
           max(attempts) AS max_attempts
    FROM ` + attempts + ` GROUP BY consumer
)
SELECT coalesce(p.consumer, a.consumer), coalesce(p.n, 0), p.oldest, p.newest,
       coalesce(a.n, 0), coalesce(a.suspects, 0), coalesce(a.max_attempts, 0)
FROM p FULL JOIN a ON a.consumer = p.consumer
ORDER BY 1`
	// In seconds: PostgreSQL reads no interval in µs, Duration's unit
	// below a millisecond.
	rows, err := db.Query(ctx, sql, suspectAge.Seconds())
	if err != nil {
		return nil, fmt.Errorf("inspect: read %s: %w", processed, tablesHint(err))
	}
	var out []Consumer
	for rows.Next() {
		var c Consumer
		var oldest, newest *time.Time
		if err := rows.Scan(&c.Name, &c.Processed, &oldest, &newest, &c.InFlight, &c.CrashSuspects, &c.MaxAttempts); err != nil {
			return nil, fmt.Errorf("inspect: read %s: %w", processed, err)
		}
		if oldest != nil {
			c.Oldest, c.Newest = *oldest, *newest
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("inspect: read %s: %w", processed, err)
	}
	return out, nil
}

// crashesCounted returns the condition of an attempt row charged more
// than one crash. Since schema version 3 the attempts column counts the
// handler's runs, a run that failed and was retried in place included (no
// crash), and the crashes column the runs that never finished, the one
// running now among them (the crash guard writes it before the run, one
// at a time, and takes it back after): more than one is a crash for
// certain; one is, once the row is older than the suspect age. Tables
// of an older version have no crashes column: there every attempt after
// the first was one a process did not survive.
func crashesCounted(ctx context.Context, db DB, attempts string) (string, error) {
	var has bool
	err := db.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute
    WHERE attrelid = to_regclass($1) AND attname = 'crashes' AND NOT attisdropped)`, attempts).Scan(&has)
	if err != nil || !has {
		return "attempts > 1", err
	}
	return "crashes > 1", nil
}

// HasRows reports whether consumer has a processed-event row or an
// attempt row: whether the tables know the name at all. Two index probes.
func HasRows(ctx context.Context, db DB, t Tables, consumer string) (bool, error) {
	processed, attempts, err := t.names()
	if err != nil {
		return false, err
	}
	var found bool
	err = db.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+processed+` WHERE consumer = $1)
    OR EXISTS (SELECT 1 FROM `+attempts+` WHERE consumer = $1)`, consumer).Scan(&found)
	if err != nil {
		return false, fmt.Errorf("inspect: read %s: %w", processed, tablesHint(err))
	}
	return found, nil
}

// ConsumerNames returns the consumer names that have processed-event
// rows, sorted, at most max of them (max <= 0: all). It reads one index
// entry per name (a skip over the primary key), not the whole table as
// Consumers does.
func ConsumerNames(ctx context.Context, db DB, t Tables, max int) ([]string, error) {
	processed, _, err := t.names()
	if err != nil {
		return nil, err
	}
	limit := any(nil) // LIMIT NULL: no limit
	if max > 0 {
		limit = max
	}
	rows, err := db.Query(ctx, `WITH RECURSIVE c(name) AS (
    (SELECT consumer FROM `+processed+` ORDER BY consumer LIMIT 1)
    UNION ALL
    SELECT (SELECT consumer FROM `+processed+` WHERE consumer > c.name ORDER BY consumer LIMIT 1)
    FROM c WHERE c.name IS NOT NULL
)
SELECT name FROM c WHERE name IS NOT NULL LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("inspect: read %s: %w", processed, tablesHint(err))
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("inspect: read %s: %w", processed, err)
	}
	return names, nil
}

// Deleter is what Retention needs: *pgxpool.Pool and *pgx.Conn have it.
// Give it a pool or a connection, not a transaction: each batch must
// commit by itself.
type Deleter interface {
	DB
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// RetentionOptions tune Retention.
type RetentionOptions struct {
	// BatchSize is the most rows one statement deletes, each statement its
	// own short transaction. Default 1000.
	BatchSize int
	// DryRun counts the rows that would go and deletes nothing.
	DryRun bool
	// Progress, when set, is called after each batch with the rows deleted
	// so far.
	Progress func(deleted int64)
	// DutyCycle is the share of its time the sweep may spend deleting
	// (dedup.DutyCycle): after a statement that took d it waits
	// d × (1 − DutyCycle) / DutyCycle, leaving the table to the consumers
	// claiming into it. It must be in (0, 1]; zero means 1, no pause.
	DutyCycle float64
}

// Retention deletes the processed-event rows of one consumer processed
// before cutoff, and its attempt rows last seen before it, in batches. It
// returns the processed-event rows deleted (or, with DryRun, that would
// be), and stops at ctx's end with what it deleted so far.
//
// A row removed no longer suppresses a redelivery of its event: cutoff
// must be older than the longest time a message can take to come back.
func Retention(ctx context.Context, db Deleter, t Tables, consumer string, cutoff time.Time, opts RetentionOptions) (int64, error) {
	processed, _, err := t.names()
	if err != nil {
		return 0, err
	}
	if consumer == "" {
		return 0, errors.New("inspect: retention needs a consumer name")
	}
	if !pgtext.Storable(consumer) {
		// As the sweep refuses it (dedup): no row can have such a name,
		// and PostgreSQL would answer with an encoding error.
		return 0, errors.New("inspect: retention: the consumer name is not UTF-8 text without NUL, which PostgreSQL cannot store")
	}
	if opts.BatchSize < 0 {
		return 0, fmt.Errorf("inspect: batch size %d is negative", opts.BatchSize)
	}
	if opts.BatchSize == 0 {
		opts.BatchSize = 1000
	}
	if opts.DutyCycle == 0 {
		opts.DutyCycle = 1
	}
	if !(opts.DutyCycle > 0 && opts.DutyCycle <= 1) {
		return 0, fmt.Errorf("inspect: duty cycle %v is not in (0, 1]", opts.DutyCycle)
	}
	if opts.DryRun {
		var n int64
		err := db.QueryRow(ctx, `SELECT count(*) FROM `+processed+` WHERE consumer = $1 AND processed_at < $2`, consumer, cutoff).Scan(&n)
		if err != nil {
			return 0, fmt.Errorf("inspect: count %s: %w", processed, tablesHint(err))
		}
		return n, nil
	}
	// dedup's sweep: from the oldest row, through the (consumer,
	// processed_at) index, where a DELETE with a plain LIMIT took each
	// batch from a scan of the whole table.
	store, err := dedup.New(dedup.Config{Schema: t.Schema, Table: t.Table})
	if err != nil {
		return 0, err
	}
	sweep := []dedup.RetentionOption{dedup.DutyCycle(opts.DutyCycle)}
	if opts.Progress != nil {
		sweep = append(sweep, dedup.Progress(opts.Progress))
	}
	n, err := store.DeleteOlderThan(ctx, db, consumer, cutoff, opts.BatchSize, sweep...)
	return n, tablesHint(err)
}
