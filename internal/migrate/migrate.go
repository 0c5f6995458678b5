package migrate

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"sort"
	"strconv"
	"text/template"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceco/once/internal/backoff"
)

// VersionTable is the name of the table that records applied migrations.
const VersionTable = "once_schema_versions"

// lockKey is the advisory lock that serialises migrations of every
// component. It is the key the unversioned dedup.Migrate took, so that an
// older process starting beside a newer one waits for it too.
const lockKey = 0x6f6e6365 // "once"

// ErrNewer is wrapped by the errors of Migrate and MigrateTo when the
// database records a version newer than the newest the code knows: a
// newer release of the library migrated it, and this one must not write
// to tables whose meaning it does not know, unless that release recorded
// that it may (every step above this code's is Additive): then Migrate
// leaves the tables as they are and returns nil.
var ErrNewer = errors.New("schema is newer than this code")

// Migration is one numbered step of a component's schema.
type Migration struct {
	Version int
	Name    string
	Up      string
	Down    string
	// Additive says that code of the version before runs on the schema
	// this step makes: it only adds what that code does not read or can
	// leave out when it writes (a nullable or defaulted column, a table,
	// an index). Its up file says so with a line "-- once:additive". A
	// release that finds the database at a newer version runs on it when
	// every step above its own is additive (a deploy rolled back), and
	// refuses it otherwise (ErrNewer).
	Additive bool
}

// additiveMark is the line of an up file that marks its step Additive.
var additiveMark = regexp.MustCompile(`(?m)^-- once:additive[ \t]*$`)

// fileName is NNN_name.up.sql or NNN_name.down.sql.
var fileName = regexp.MustCompile(`^([0-9]+)_([a-z0-9_]+)\.(up|down)\.sql$`)

// Load reads the migration templates at the top of fsys, renders each with
// data and returns them ordered by version. Every file must be named
// NNN_name.up.sql or NNN_name.down.sql; versions must be 1, 2, 3, …
// without a gap, each with an up and a down file of the same name.
func Load(fsys fs.FS, data any) ([]Migration, error) {
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	byVersion := map[int]*Migration{}
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		if err := loadFile(fsys, e.Name(), data, byVersion); err != nil {
			return nil, err
		}
	}
	return ordered(byVersion)
}

// loadFile renders one migration file into its version's Migration.
func loadFile(fsys fs.FS, name string, data any, byVersion map[int]*Migration) error {
	m := fileName.FindStringSubmatch(name)
	if m == nil {
		return fmt.Errorf("migrate: %s: not named NNN_name.up.sql or NNN_name.down.sql", name)
	}
	version, _ := strconv.Atoi(m[1])
	text, err := render(fsys, name, data)
	if err != nil {
		return err
	}
	mig := byVersion[version]
	if mig == nil {
		mig = &Migration{Version: version, Name: m[2]}
		byVersion[version] = mig
	}
	if mig.Name != m[2] {
		return fmt.Errorf("migrate: version %d is named both %q and %q", version, mig.Name, m[2])
	}
	if m[3] == "up" {
		mig.Up = text
		mig.Additive = additiveMark.MatchString(text)
	} else {
		mig.Down = text
	}
	return nil
}

func render(fsys fs.FS, name string, data any) (string, error) {
	src, err := fs.ReadFile(fsys, name)
	if err != nil {
		return "", fmt.Errorf("migrate: %w", err)
	}
	t, err := template.New(name).Option("missingkey=error").Parse(string(src))
	if err != nil {
		return "", fmt.Errorf("migrate: %w", err)
	}
	var b bytes.Buffer
	if err := t.Execute(&b, data); err != nil {
		return "", fmt.Errorf("migrate: %w", err)
	}
	return b.String(), nil
}

// ordered checks that the versions are 1..n, each complete, and sorts them.
func ordered(byVersion map[int]*Migration) ([]Migration, error) {
	out := make([]Migration, 0, len(byVersion))
	for _, m := range byVersion {
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	for i, m := range out {
		if m.Version != i+1 {
			return nil, fmt.Errorf("migrate: version %d follows %d: versions must be 1, 2, 3, … without a gap", m.Version, i)
		}
		if m.Up == "" || m.Down == "" {
			return nil, fmt.Errorf("migrate: version %d (%s) needs both an up and a down file", m.Version, m.Name)
		}
	}
	return out, nil
}

// Beginner starts a transaction: *pgxpool.Pool and *pgx.Conn satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Querier runs one query: *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy it.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Series is the numbered migrations of one component. It holds no
// connection and is safe for concurrent use once built.
type Series struct {
	// Component names the series in the version table. Two series that
	// share a schema must have different components; a component whose
	// table names are configurable includes them (dedup uses
	// "dedup:processed_events").
	Component string
	// Schema holds the version table: the schema of the component's
	// tables. "" resolves it through the connection's search_path, or
	// from Anchor.
	Schema string
	// Anchor, with Schema "", is the quoted name of one of the component's
	// tables, unqualified: the version table is kept in the schema that
	// holds it, where the search_path finds it, or, before it exists, in
	// the schema where the migrations' unqualified CREATE TABLE puts it
	// (current_schema()), rather than in whichever schema of the
	// search_path holds a version table first. A version table found so
	// that already records the component is still used (releases before
	// Anchor recorded versions there). "" leaves the version table to the
	// search_path.
	Anchor string
	// SearchPath, with Schema set, puts Schema first on the search_path
	// while the migrations run, for files that name their tables
	// unqualified.
	SearchPath bool
	// Migrations are the component's steps, from Load.
	Migrations []Migration
	// Adopt, when not nil, is called (inside the migration's transaction,
	// under the lock) when the version table records nothing for the
	// component. It returns the version at which the database already is:
	// 0 when the component's tables do not exist, or the version that
	// objects created before versions were recorded correspond to, which
	// is then recorded without running those migrations. An error stops
	// the migration.
	Adopt func(ctx context.Context, tx pgx.Tx) (int, error)
	// Verify, when not nil, is called after the last migration, in the
	// same transaction, when the target is the newest version: an error
	// (a table of another shape) rolls everything back.
	Verify func(ctx context.Context, tx pgx.Tx) error
	// Gone, when not nil, is called (inside the migration's transaction,
	// under the lock) with the recorded version, when it is one the
	// series knows: it reports whether a table that version has is gone,
	// dropped or renamed by hand after the version was recorded. The up
	// steps to that version then run again (their statements must be
	// idempotent: IF NOT EXISTS, IF EXISTS) before the migration goes on,
	// so that Migrate makes the tables again, empty, and the down steps
	// find what they alter; without it both failed on the missing table
	// for ever, and only an edit of the version table by hand got out.
	Gone func(ctx context.Context, tx pgx.Tx, version int) (bool, error)
}

// Latest is the newest version the series knows.
func (s *Series) Latest() int { return len(s.Migrations) }

// versionTable returns the quoted name of the component's version table:
// in Schema, or, with Schema "", in the schema of Anchor (see Anchor), or
// found through the search_path.
func (s *Series) versionTable(ctx context.Context, db Querier) (string, error) {
	if s.Schema != "" {
		return pgx.Identifier{s.Schema, VersionTable}.Sanitize(), nil
	}
	onPath := pgx.Identifier{VersionTable}.Sanitize()
	if s.Anchor == "" {
		return onPath, nil
	}
	// The anchor's schema, or the one CREATE TABLE would put it in; and
	// whether that schema has a version table, and whether the one on
	// the search_path records the component.
	var (
		schema           *string
		beside, recorded bool
	)
	err := db.QueryRow(ctx, `WITH home AS (
	SELECT coalesce((SELECT c.relnamespace::regnamespace::text FROM pg_class c WHERE c.oid = to_regclass($1)),
		quote_ident(current_schema())) AS schema,
	to_regclass($1) IS NOT NULL AS anchored
)
SELECT home.schema, to_regclass(home.schema || '.' || $2) IS NOT NULL,
	home.anchored AND to_regclass($2) IS NOT NULL
FROM home`, s.Anchor, onPath).Scan(&schema, &beside, &recorded)
	if err != nil {
		return "", err
	}
	if schema == nil {
		// No schema on the search_path exists: CREATE TABLE will say so.
		return onPath, nil
	}
	home := *schema + "." + onPath
	if beside || !recorded {
		return home, nil
	}
	// The anchor exists, its schema has no version table, and the
	// search_path finds one: the versions of a release before Anchor,
	// if that table records the component.
	if err := db.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+onPath+` WHERE component = $1)`, s.Component).Scan(&recorded); err != nil {
		return "", err
	}
	if recorded {
		return onPath, nil
	}
	return home, nil
}

// Migrate brings the component to its newest version. It is idempotent and
// safe to call from many processes at once. A database at a newer version
// is left as it is: nil after Verify when the release that migrated it
// recorded that this code runs on it (every step above is Additive), an
// error wrapping ErrNewer otherwise.
func (s *Series) Migrate(ctx context.Context, db Beginner) error {
	return s.MigrateTo(ctx, db, s.Latest())
}

// MigrateTo moves the component to version target, running up migrations
// in order or down migrations in reverse order; 0 removes the component's
// tables. Everything runs in one transaction: on any error nothing
// changes. A transaction that waited too long for a table's lock (see
// firstStepLockTimeout) is rolled back and tried again until ctx ends, and
// one whose session the server ended for idling (the process held up
// between two statements) up to maxIdledOut times. A
// recorded version newer than the series knows fails with an error
// wrapping ErrNewer; a target outside 0..Latest is an error.
func (s *Series) MigrateTo(ctx context.Context, db Beginner, target int) error {
	if target < 0 || target > s.Latest() {
		return fmt.Errorf("migrate: %s: version %d does not exist (0 to %d)", s.Component, target, s.Latest())
	}
	wait := backoff.Retrier{Policy: lockWait}
	idled := 0
	for limit := firstStepLockTimeout; ; {
		err := s.migrateOnce(ctx, db, target, limit)
		switch {
		case err == nil || ctx.Err() != nil:
			return err
		case idledOut(err) && idled < maxIdledOut:
			// The server ended the session for idling in the
			// transaction, whose statements follow each other at once:
			// only the process held up between two of them (a busy
			// machine, a paused VM) idles it. A setting too short for
			// any migration fails every try, and is returned.
			idled++
		case !lockTimedOut(err) || limit == 0:
			return err
		default:
			// A step waited limit for a table that another transaction
			// uses: rolled back, the writers queued behind it go on,
			// and the migration tries again, waiting twice as long, so
			// that it gets its turn beside transactions that last long
			// too.
			if limit *= 2; limit > lastStepLockTimeout {
				limit = 0
			}
		}
		if !wait.Wait(ctx) {
			return err
		}
	}
}

// maxIdledOut is how many times MigrateTo tries again after the server
// ended its session past idle_in_transaction_session_timeout (25P03).
const maxIdledOut = 3

// idledOut reports whether err is the server ending the session past
// idle_in_transaction_session_timeout (25P03).
func idledOut(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "25P03"
}

// migrateOnce runs the migration to target in one transaction whose waits
// for a lock end after lockTimeout (0: the session's lock_timeout).
func (s *Series) migrateOnce(ctx context.Context, db Beginner, target int, lockTimeout time.Duration) error {
	tx, err := beginLocked(ctx, db)
	if err != nil {
		return fmt.Errorf("migrate: %s: %w", s.Component, err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	if err := limitLockWaits(ctx, tx, lockTimeout); err != nil {
		return fmt.Errorf("migrate: %s: %w", s.Component, err)
	}
	if err := s.migrate(ctx, tx, target); err != nil {
		return fmt.Errorf("migrate: %s: %w", s.Component, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("migrate: %s: %w", s.Component, err)
	}
	return nil
}

// A step that waits for a table another transaction uses (an ALTER TABLE
// behind a long transaction that wrote to it) holds every later writer of
// the table behind it in PostgreSQL's lock queue. So a migration's first
// try waits firstStepLockTimeout at most for a lock, then is rolled back
// (the writers go on) and tried again, each try waiting twice as long;
// past lastStepLockTimeout a try waits as the session does, so that a
// migration beside transactions that never pause still gets its turn.
const (
	firstStepLockTimeout = time.Second
	lastStepLockTimeout  = time.Minute
)

// limitLockWaits sets lock_timeout to d for tx, unless d is 0 or the
// session's is shorter.
func limitLockWaits(ctx context.Context, tx pgx.Tx, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	_, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1::bigint::text, true)
		WHERE (SELECT setting::bigint FROM pg_settings WHERE name = 'lock_timeout') NOT BETWEEN 1 AND $1::bigint`, d.Milliseconds())
	return err
}

// lockTimedOut reports whether err is a lock_timeout (55P03).
func lockTimedOut(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "55P03"
}

// lockWait paces beginLocked's tries while another transaction holds the
// migration lock.
var lockWait = backoff.Policy{Initial: 20 * time.Millisecond, Max: time.Second}

// beginLocked begins a transaction that holds the migration lock. While
// another transaction holds it (another process's migration, which may
// build an index for seconds), it tries again in a new transaction after
// lockWait, rather than wait in a statement: the session's
// statement_timeout would end such a wait with an error, and the start of
// the process that migrates with it. A process of an older release, which
// waits in pg_advisory_xact_lock, still takes its turn.
func beginLocked(ctx context.Context, db Beginner) (pgx.Tx, error) {
	wait := backoff.Retrier{Policy: lockWait}
	for {
		tx, err := db.Begin(ctx)
		if err != nil {
			return nil, err
		}
		var locked bool
		err = tx.QueryRow(ctx, "SELECT pg_try_advisory_xact_lock($1)", lockKey).Scan(&locked)
		if err == nil && locked {
			return tx, nil
		}
		_ = tx.Rollback(ctx) // a transaction that holds nothing
		if err != nil {
			return nil, err
		}
		if !wait.Wait(ctx) {
			return nil, fmt.Errorf("waiting for the migration lock, held by another transaction: %w", ctx.Err())
		}
	}
}

func (s *Series) migrate(ctx context.Context, tx pgx.Tx, target int) error {
	if s.SearchPath && s.Schema != "" {
		if _, err := tx.Exec(ctx, "SET LOCAL search_path TO "+pgx.Identifier{s.Schema}.Sanitize()); err != nil {
			return err
		}
	}
	table, err := s.versionTable(ctx, tx)
	if err != nil {
		return err
	}
	if err := createVersionTable(ctx, tx, table); err != nil {
		return err
	}
	current, err := s.current(ctx, tx, table)
	if err != nil {
		return err
	}
	if current > s.Latest() {
		return s.newer(ctx, tx, table, current, target)
	}
	if err := s.remake(ctx, tx, current); err != nil {
		return err
	}
	for v := current + 1; v <= target; v++ {
		if err := s.step(ctx, tx, table, s.Migrations[v-1], true); err != nil {
			return err
		}
	}
	for v := current; v > target; v-- {
		if err := s.step(ctx, tx, table, s.Migrations[v-1], false); err != nil {
			return err
		}
	}
	if target == s.Latest() && s.Verify != nil {
		return s.Verify(ctx, tx)
	}
	return nil
}

// remake runs the up steps to current again, unrecorded (they are), when
// Gone reports that a table of that version is gone.
func (s *Series) remake(ctx context.Context, tx pgx.Tx, current int) error {
	if s.Gone == nil || current == 0 {
		return nil
	}
	gone, err := s.Gone(ctx, tx, current)
	if err != nil || !gone {
		return err
	}
	for _, m := range s.Migrations[:current] {
		if _, err := tx.Exec(ctx, m.Up); err != nil {
			return fmt.Errorf("making again the tables of version %d, some of which are gone: version %d (%s) up: %w", current, m.Version, m.Name, err)
		}
	}
	return nil
}

// newer answers a database at version current, above the newest this
// code knows: nil, leaving it as it is, when target is that newest version
// and the release that migrated it recorded that code of this version runs
// on it (every step above this code's is Additive; see compatibleFrom),
// after Verify; an error wrapping ErrNewer otherwise, as for a target
// below (this code has no down migrations from there).
func (s *Series) newer(ctx context.Context, tx pgx.Tx, table string, current, target int) error {
	from, err := recordedCompatibleFrom(ctx, tx, table, s.Component, current)
	if err != nil {
		return err
	}
	if target == s.Latest() && from > 0 && from <= s.Latest() {
		if s.Verify != nil {
			return s.Verify(ctx, tx)
		}
		return nil
	}
	if from > s.Latest() {
		return fmt.Errorf("%w: the database is at version %d, which needs code of version %d or later, and this code knows versions up to %d: run a release of the library that knows version %d, or move the schema down with it first", ErrNewer, current, from, s.Latest(), current)
	}
	return fmt.Errorf("%w: the database is at version %d, this code knows versions up to %d: run a release of the library that knows version %d", ErrNewer, current, s.Latest(), current)
}

// compatibleFrom is the oldest version whose code runs on the schema at
// version v: v itself, or lower while the steps up to v are Additive.
func (s *Series) compatibleFrom(v int) int {
	from := v
	for from > 1 && s.Migrations[from-1].Additive {
		from--
	}
	return from
}

// compatibleColumn is the version table's column recording, for each
// version, the oldest version whose code runs on it (compatibleFrom).
// Version tables made before it have no such column; the next recorded
// step adds it.
const compatibleColumn = "compatible_from"

// hasCompatibleColumn reports whether the version table has
// compatibleColumn.
func hasCompatibleColumn(ctx context.Context, q Querier, table string) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped)`, table, compatibleColumn).Scan(&ok)
	return ok, err
}

// recordedCompatibleFrom returns what the version table records as the
// oldest version whose code runs on component's version v; 0 when it
// records nothing (a release before the column, or a row written by hand).
func recordedCompatibleFrom(ctx context.Context, q Querier, table, component string, v int) (int, error) {
	ok, err := hasCompatibleColumn(ctx, q, table)
	if err != nil || !ok {
		return 0, err
	}
	var from *int
	err = q.QueryRow(ctx, `SELECT `+compatibleColumn+` FROM `+table+` WHERE component = $1 AND version = $2`, component, v).Scan(&from)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return 0, nil
	case err != nil:
		return 0, err
	case from == nil:
		return 0, nil
	}
	return *from, nil
}

// createVersionTable creates the version table when it does not exist.
// It looks first: CREATE TABLE IF NOT EXISTS needs the CREATE privilege on
// the schema even when the table exists, and a service whose user may only
// write rows must start on a schema an administrator migrated.
func createVersionTable(ctx context.Context, tx pgx.Tx, table string) error {
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil || exists {
		return err
	}
	_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+table+` (
    component  text        NOT NULL,
    version    integer     NOT NULL,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    compatible_from integer,
    PRIMARY KEY (component, version)
)`)
	return err
}

// current is the component's recorded version, adopting objects that
// predate the version table when nothing is recorded.
func (s *Series) current(ctx context.Context, tx pgx.Tx, table string) (int, error) {
	var v int
	err := tx.QueryRow(ctx, `SELECT coalesce(max(version), 0) FROM `+table+` WHERE component = $1`, s.Component).Scan(&v)
	if err != nil || v > 0 || s.Adopt == nil {
		return v, err
	}
	adopted, err := s.Adopt(ctx, tx)
	if err != nil {
		return 0, err
	}
	if adopted < 0 || adopted > s.Latest() {
		return 0, fmt.Errorf("adopting existing tables: version %d does not exist", adopted)
	}
	for i := 0; i < adopted; i++ {
		if err := s.record(ctx, tx, table, s.Migrations[i]); err != nil {
			return 0, err
		}
	}
	return adopted, nil
}

// step runs one migration up or down and records it.
func (s *Series) step(ctx context.Context, tx pgx.Tx, table string, m Migration, up bool) error {
	sql, what := m.Up, "up"
	if !up {
		sql, what = m.Down, "down"
	}
	// No arguments: pgx sends the text with the simple protocol, which
	// runs several statements.
	if _, err := tx.Exec(ctx, sql); err != nil {
		return fmt.Errorf("version %d (%s) %s: %w", m.Version, m.Name, what, err)
	}
	if up {
		return s.record(ctx, tx, table, m)
	}
	_, err := tx.Exec(ctx, `DELETE FROM `+table+` WHERE component = $1 AND version = $2`, s.Component, m.Version)
	return err
}

// record records m as applied, with the oldest version whose code runs on
// it, adding that column to a version table made before it.
func (s *Series) record(ctx context.Context, tx pgx.Tx, table string, m Migration) error {
	ok, err := hasCompatibleColumn(ctx, tx, table)
	if err != nil {
		return err
	}
	if !ok {
		if _, err := tx.Exec(ctx, `ALTER TABLE `+table+` ADD COLUMN IF NOT EXISTS `+compatibleColumn+` integer`); err != nil {
			return err
		}
	}
	_, err = tx.Exec(ctx, `INSERT INTO `+table+` (component, version, name, `+compatibleColumn+`) VALUES ($1, $2, $3, $4)`,
		s.Component, m.Version, m.Name, s.compatibleFrom(m.Version))
	return err
}

// Version returns the component's recorded version: 0 when nothing is
// recorded (or the version table does not exist). It takes no lock.
func (s *Series) Version(ctx context.Context, db Querier) (int, error) {
	table, err := s.versionTable(ctx, db)
	if err != nil {
		return 0, wrapVersionErr(s.Component, err)
	}
	var exists bool
	err = db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists)
	if err != nil || !exists {
		return 0, wrapVersionErr(s.Component, err)
	}
	var v int
	err = db.QueryRow(ctx, `SELECT coalesce(max(version), 0) FROM `+table+` WHERE component = $1`, s.Component).Scan(&v)
	return v, wrapVersionErr(s.Component, err)
}

func wrapVersionErr(component string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("migrate: %s: version: %w", component, err)
}
