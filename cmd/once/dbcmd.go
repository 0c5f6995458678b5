package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/inspect"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/outbox"
)

const migrateUsage = `Usage: once migrate [up|down|status] [-database-url URL] [-schema S] [-table T] [-to V] [-json]

up (the default) brings the processed-events and attempts tables to the newest
schema version, the same numbered migrations a consumer runs at start unless
Config.SkipMigrate: idempotent, serialised by an advisory lock; a schema a
newer release migrated is left as it is when that release recorded that this
one runs on it (its steps only add), and refused otherwise. down -to V
moves them back to version V (0 drops them), and is refused for a V above
the version the database records.
status prints the version the database records; where none is, it says
whether the tables are missing or were made without a record (by goose,
golang-migrate, by hand), and then whether they have the store's shape
(-json: tables_exist, shape_error); where one is, whether a table is gone
or of another shape (shape_error): up makes a table dropped by hand again.`

const statusUsage = `Usage: once status [-database-url URL] [-kafka BROKERS -group G -topic T] [-amqp URL -queue Q] [-dlq NAME] [-json]

Per consumer name: processed rows, the oldest and newest, attempt rows
(messages in flight that may be redeliveries) and crash suspects among them
(charged more than one crash, or not seen for -suspect-age; MAX ATTEMPTS
counts the handler's runs, failed ones included). With -dlq, the dead
letters of that topic or queue by consumer and kind. With -kafka, -group and
-topic, the group's lag per partition; with -amqp and -queue, the depth of
each queue. Counting rows reads the whole table. A part that cannot be read
(a missing topic, a broker down) is reported on stderr (and in -json's
"errors"), the others are printed, and the exit code is 1.`

const retentionUsage = `Usage: once retention -consumer NAME -older-than DURATION [-batch N] [-duty-cycle SHARE] [-dry-run] [-database-url URL]

Deletes the processed-event rows of one consumer processed more than
DURATION ago (and its attempt rows last seen before then), -batch rows per
statement, each its own short transaction, printing progress. It spends
at most -duty-cycle of its time deleting (default 0.1, as a consumer's
own retention: the running consumers keep the table's indexes); -duty-cycle 1
deletes as fast as the database allows, for a table nobody writes. A deleted row
no longer suppresses a redelivery of its event: DURATION must exceed the
longest time a message can take to come back (docs/operations.md), and be
at least 1s. A consumer name with no rows at all (misspelt?) deletes
nothing and is warned of on stderr, naming the consumers that have rows;
the exit code is still 0.`

// maxNamesWarned bounds the consumer names a warning lists.
const maxNamesWarned = 20

// warnNoRows tells on stderr that consumer has no rows in the tables of
// db, naming the consumers that have some.
func (a *app) warnNoRows(ctx context.Context, pool *pgxpool.Pool, db *dbFlags, consumer string) {
	names, err := inspect.ConsumerNames(ctx, pool, db.tables(), maxNamesWarned+1)
	var others string
	switch {
	case err != nil:
		others = fmt.Sprintf("the consumers that have rows could not be read: %v", err)
	case len(names) == 0:
		others = "no consumer has rows in it"
	case len(names) > maxNamesWarned:
		others = "consumers with processed rows: " + strings.Join(names[:maxNamesWarned], ", ") + ", ... (once status lists them all)"
	default:
		others = "consumers with processed rows: " + strings.Join(names, ", ")
	}
	fmt.Fprintf(a.stderr, "once: retention: warning: consumer %q has no rows in %s (a misspelt -consumer?); %s\n", consumer, *db.table, others)
}

// dbFlags are the flags of commands that use PostgreSQL.
type dbFlags struct {
	url, schema, table *string
	// connectTimeout is the bound of a connection attempt, set by open.
	connectTimeout time.Duration
}

func (a *app) dbFlagsOn(fs *flag.FlagSet) *dbFlags {
	return &dbFlags{
		url:    fs.String("database-url", a.getenv("DATABASE_URL"), "PostgreSQL `URL` (env DATABASE_URL)"),
		schema: fs.String("schema", "", "`schema` of the tables (default: the search_path)"),
		table:  fs.String("table", dedup.DefaultTable, "processed-events `table`; its attempts table has the suffix _attempts"),
	}
}

func (f *dbFlags) tables() inspect.Tables {
	return inspect.Tables{Schema: *f.schema, Table: *f.table}
}

// pool checks -schema and -table, and connects to -database-url.
func (f *dbFlags) pool(ctx context.Context) (*pgxpool.Pool, error) {
	pool, err := f.open(ctx)
	if err != nil {
		return nil, err
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, f.connectError(ctx, err)
	}
	return pool, nil
}

// dbConnectTimeout bounds each connection attempt to -database-url when
// the URL sets no connect_timeout: a server that accepts connections and
// never answers (a wrong port, a hung server) fails the command instead
// of holding it until Ctrl-C.
var dbConnectTimeout = 10 * time.Second

// open checks -schema and -table, and returns a pool on -database-url
// that connects when first used.
func (f *dbFlags) open(ctx context.Context) (*pgxpool.Pool, error) {
	if *f.url == "" {
		return nil, usagef("-database-url (or DATABASE_URL) is required")
	}
	if _, err := dedup.New(dedup.Config{Schema: *f.schema, Table: *f.table}); err != nil {
		return nil, &usageError{err.Error()}
	}
	cfg, err := pgxpool.ParseConfig(*f.url)
	if err != nil {
		return nil, usagef("-database-url does not parse")
	}
	cfg.MaxConns = 2
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = dbConnectTimeout
	}
	f.connectTimeout = cfg.ConnConfig.ConnectTimeout
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, f.connectError(ctx, err)
	}
	return pool, nil
}

// connectError is the error of a connection to -database-url that failed
// with err.
func (f *dbFlags) connectError(ctx context.Context, err error) error {
	if ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("connect to PostgreSQL: no answer within %v (connect_timeout in -database-url sets another bound): %w",
			f.connectTimeout, err)
	}
	return fmt.Errorf("connect to PostgreSQL: %w", err)
}

func (a *app) migrate(ctx context.Context, args []string) error {
	fs, helpOnly := a.flags(ctx, "migrate")
	db := a.dbFlagsOn(fs)
	to := fs.Int("to", 0, "with down: the `version` to go down to (0 drops the tables)")
	asJSON := fs.Bool("json", false, "print JSON (status)")
	if helpOnly {
		return nil
	}
	action := "up"
	if len(args) > 0 && len(args[0]) > 0 && args[0][0] != '-' {
		action, args = args[0], args[1:]
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	switch action {
	case "up", "down", "status":
	default:
		return usagef("unknown action %q: want up, down or status", action)
	}
	toSet := false
	fs.Visit(func(f *flag.Flag) { toSet = toSet || f.Name == "to" })
	switch {
	case action == "down" && (!toSet || *to < 0 || *to >= dedup.SchemaVersion):
		// No default: a bare "down" must not drop the tables.
		return usagef("migrate down needs -to, a version from 0 to %d", dedup.SchemaVersion-1)
	case action != "down" && toSet:
		// Ignored, it would take "up -to 3" to the newest version, which
		// an older release refuses.
		return usagef("-to goes with down only (up brings the tables to the newest version, %d)", dedup.SchemaVersion)
	}
	store, err := dedup.New(dedup.Config{Schema: *db.schema, Table: *db.table})
	if err != nil {
		return &usageError{err.Error()}
	}
	pool, err := db.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if action == "down" {
		// MigrateTo goes up as well: a -to above the recorded version
		// would run the migrations up to it.
		current, err := store.Version(ctx, pool)
		if err != nil {
			return err
		}
		if *to > current {
			return fmt.Errorf("migrate down -to %d: %s is at schema version %d; down does not migrate up (migrate up brings it to %d)",
				*to, *db.table, current, dedup.SchemaVersion)
		}
	}
	switch action {
	case "up":
		err = store.Migrate(ctx, pool)
	case "down":
		err = store.MigrateTo(ctx, pool, *to)
	}
	if err != nil {
		return err
	}
	version, err := store.Version(ctx, pool)
	if err != nil {
		return err
	}
	// Version 0 is both no tables and tables no version was recorded for
	// (made by goose, golang-migrate, by hand, or by a release before
	// versions were recorded): tell them apart, and whether such a table
	// is the store's.
	var tablesExist bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, store.ProcessedTable()).Scan(&tablesExist); err != nil {
		return fmt.Errorf("read %s: %w", *db.table, err)
	}
	var shapeErr error
	switch {
	case version == 0 && tablesExist:
		// Tables of an older release, or of migration files applied
		// part of the way, lack what later versions add: Migrate adopts
		// and completes them. Only what it would refuse is an error.
		shapeErr = store.CheckUnrecorded(ctx, pool)
	case version > 0 && action == "status":
		// A version is recorded, but a table may have been dropped by
		// hand since: "schema version N" would read as all well.
		shapeErr = store.Check(ctx, pool)
	}
	if *asJSON {
		// schema "" means the tables found through the search_path.
		rep := map[string]any{"schema": *db.schema, "table": *db.table,
			"version": version, "latest": dedup.SchemaVersion, "tables_exist": tablesExist}
		if shapeErr != nil {
			rep["shape_error"] = shapeErr.Error()
		}
		return json.NewEncoder(a.stdout).Encode(rep)
	}
	switch {
	case action == "status" && version == 0 && !tablesExist:
		fmt.Fprintf(a.stdout, "%s: no tables (schema version 0 of %d; migrate up creates them)\n", *db.table, dedup.SchemaVersion)
	case action == "status" && version == 0 && shapeErr != nil:
		fmt.Fprintf(a.stdout, "%s: no schema version recorded, and the table of that name is not the store's (migrate up and a consumer's start refuse it): %v\n",
			*db.table, shapeErr)
	case action == "status" && version == 0:
		fmt.Fprintf(a.stdout, "%s: no schema version recorded, but the tables exist with the store's shape (made by another tool, by hand, "+
			"or by a release before versions were recorded); migrate up, or a consumer's start, records them and brings them to version %d\n",
			*db.table, dedup.SchemaVersion)
	case action == "status" && shapeErr != nil:
		fmt.Fprintf(a.stdout, "%s: schema version %d of %d recorded, but the tables are not as it made them "+
			"(migrate up makes a table dropped by hand again, empty): %v\n", *db.table, version, dedup.SchemaVersion, shapeErr)
	case action == "status":
		fmt.Fprintf(a.stdout, "%s: schema version %d of %d\n", *db.table, version, dedup.SchemaVersion)
	default:
		fmt.Fprintf(a.stdout, "migrated: %s at schema version %d\n", migratedTables(*db.table, version), version)
	}
	return nil
}

// migratedTables names the tables of a processed-events table at version:
// its attempts table always, its offsets table from version 4 (the version
// that creates it).
func migratedTables(table string, version int) string {
	switch {
	case version == 0:
		return table + " (its tables dropped)"
	case version >= 4:
		return table + ", " + table + "_attempts and " + table + "_offsets"
	default:
		return table + " and " + table + "_attempts"
	}
}

// statusReport is the output of once status.
type statusReport struct {
	// Consumers is [] when no consumer has rows: a script iterates
	// over it without a case for null.
	Consumers []inspect.Consumer `json:"consumers"`
	// DeadLetters is there with -dlq, [] when the destination holds
	// none (omitzero: a nil slice, no -dlq, leaves it out).
	DeadLetters []dlq.KindCount        `json:"dead_letters,omitzero"`
	DLQ         string                 `json:"dlq,omitempty"`
	Lag         []inspect.PartitionLag `json:"lag,omitempty"`
	Queues      []inspect.QueueDepth   `json:"queues,omitempty"`
	// Outbox is the transactional outbox's state, when its table exists.
	Outbox *outboxReport `json:"outbox,omitempty"`
	// Errors say which parts could not be read, and why; the report
	// holds the others.
	Errors []string `json:"errors,omitempty"`
}

// outboxReport is the outbox table's rows by state, and the parked ones.
type outboxReport struct {
	Table  string             `json:"table"`
	Status outbox.Status      `json:"status"`
	Parked []outbox.ParkedRow `json:"parked,omitempty"`
}

func (a *app) status(ctx context.Context, args []string) error {
	fs, helpOnly := a.flags(ctx, "status")
	db := a.dbFlagsOn(fs)
	kafka := a.kafkaFlagsOn(fs)
	kafkaBrokers := kafka.brokers
	group := fs.String("group", "", "Kafka consumer `group` whose lag to show")
	topics := fs.String("topic", "", "Kafka `topics` of the group, comma-separated")
	amqpURL := fs.String("amqp", a.getenv("ONCE_AMQP_URL"), "RabbitMQ `URL` (env ONCE_AMQP_URL)")
	queues := fs.String("queue", "", "RabbitMQ `queues` whose depth to show, comma-separated")
	dlqName := fs.String("dlq", "", "dead-letter topic or queue to count by consumer and kind")
	suspectAge := fs.Duration("suspect-age", 5*time.Minute, "an attempt row not seen for this long is a crash suspect")
	outboxTable := fs.String("outbox", outbox.DefaultTable, "the outbox `table` whose pending and parked rows to show, when it exists (in -schema)")
	asJSON := fs.Bool("json", false, "print JSON")
	if helpOnly {
		return nil
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	if (*group == "") != (*topics == "") {
		return usagef("-group and -topic go together")
	}
	if *group != "" && *kafkaBrokers == "" {
		return usagef("-group needs -kafka")
	}
	if *queues != "" && *amqpURL == "" {
		return usagef("-queue needs -amqp")
	}
	if *suspectAge < 0 {
		return usagef("-suspect-age %v: want a duration of 0 or more", *suspectAge)
	}
	// The dead-letter destination and the Kafka settings are checked
	// before connecting: a bad one is a usage error.
	var ksc *sarama.Config
	if *group != "" {
		var err error
		if ksc, err = kafka.config(a.stderr); err != nil {
			return err
		}
	}
	var q dlq.Queue
	if *dlqName != "" {
		kb, au := chosen(fs, *kafkaBrokers, *amqpURL)
		if *group == "" && *queues == "" && kb != "" && au != "" {
			return usagef("-dlq: give -kafka or -amqp, not both")
		}
		if kb != "" && au != "" {
			au = "" // the Kafka flags were given for the lag: the DLQ is a topic
		}
		if kb != "" && ksc == nil {
			var err error
			if ksc, err = kafka.config(a.stderr); err != nil {
				return err
			}
		}
		var err error
		if q, err = openQueue(kb, ksc, au, *dlqName, dlq.AMQPConfig{}); err != nil {
			return err
		}
		q = a.wrapped(q)
		defer q.Close()
	}
	if _, err := outbox.New(outbox.Config{Schema: *db.schema, Table: *outboxTable}); err != nil {
		return &usageError{err.Error()}
	}
	var rep statusReport
	pool, err := db.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if rep.Consumers, err = inspect.Consumers(ctx, pool, db.tables(), *suspectAge); err != nil {
		return err
	}
	if rep.Consumers == nil {
		rep.Consumers = []inspect.Consumer{}
	}
	// Each part that fails is reported, and the others are read and
	// printed all the same; after an interrupt none is read.
	var failed []error
	part := func(what string, read func() error) {
		err := ctx.Err()
		if err == nil {
			err = read()
		}
		if err != nil {
			failed = append(failed, fmt.Errorf("%s: %w", what, err))
			rep.Errors = append(rep.Errors, what+": "+err.Error())
		}
	}
	part("outbox", func() (err error) {
		rep.Outbox, err = outboxStatus(ctx, pool, *db.schema, *outboxTable)
		return err
	})
	if q != nil {
		part("dead letters of "+q.Name(), func() error {
			var kinds dlq.Tally // counted as read: a large topic is not held
			if err := q.Browse(ctx, func(r *dlq.Record) error { kinds.Add(r); return nil }); err != nil {
				return err
			}
			rep.DLQ, rep.DeadLetters = q.Name(), kinds.Counts()
			return nil
		})
	}
	if *group != "" {
		part("kafka lag of group "+*group, func() (err error) {
			rep.Lag, err = inspect.KafkaLag(ctx, splitList(*kafkaBrokers), ksc, *group, splitList(*topics))
			return err
		})
	}
	if *queues != "" {
		part("rabbitmq queues", func() (err error) {
			rep.Queues, err = inspect.AMQPDepth(ctx, *amqpURL, splitList(*queues))
			return err
		})
	}
	if *asJSON {
		if err := a.writeJSON(rep); err != nil {
			return err
		}
	} else {
		a.printStatus(rep)
	}
	return partsFailed(failed)
}

// partsFailed is the error of the parts of a report that failed, one
// after the other on a line; nil when none did.
func partsFailed(errs []error) error {
	switch len(errs) {
	case 0:
		return nil
	case 1:
		return errs[0]
	}
	msgs := make([]string, len(errs))
	for i, err := range errs {
		msgs[i] = err.Error()
	}
	return &joinedError{msg: strings.Join(msgs, "; "), errs: errs}
}

type joinedError struct {
	msg  string
	errs []error
}

func (e *joinedError) Error() string   { return e.msg }
func (e *joinedError) Unwrap() []error { return e.errs }

// outboxStatus reads the outbox table's state, or returns nil when the
// table does not exist (the service has no outbox).
func outboxStatus(ctx context.Context, pool *pgxpool.Pool, schema, table string) (*outboxReport, error) {
	store, err := outbox.New(outbox.Config{Schema: schema, Table: table})
	if err != nil {
		return nil, &usageError{err.Error()}
	}
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, store.Table()).Scan(&exists); err != nil || !exists {
		return nil, err
	}
	st, err := store.Status(ctx, pool)
	if err != nil {
		return nil, err
	}
	parked, err := store.Parked(ctx, pool, 20)
	if err != nil {
		return nil, err
	}
	return &outboxReport{Table: store.Table(), Status: st, Parked: parked}, nil
}

func (a *app) printStatus(rep statusReport) {
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "CONSUMER\tPROCESSED\tOLDEST\tNEWEST\tIN FLIGHT\tCRASH SUSPECTS\tMAX ATTEMPTS")
	for _, c := range rep.Consumers {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%d\t%d\t%d\n", safe(c.Name), c.Processed, formatTime(c.Oldest), formatTime(c.Newest),
			c.InFlight, c.CrashSuspects, c.MaxAttempts)
	}
	if len(rep.Consumers) == 0 {
		fmt.Fprintln(tw, "(no consumer has processed anything)")
	}
	_ = tw.Flush()
	if rep.DLQ != "" {
		fmt.Fprintf(a.stdout, "\ndead letters in %s:\n", rep.DLQ)
		tw = tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "CONSUMER\tKIND\tCOUNT\tREPLAYABLE\tLAST")
		for _, k := range rep.DeadLetters {
			consumer, kind := orDash(k.Consumer), orDash(k.Kind)
			if k.Others {
				// Not records without a consumer or kind ("-"): those
				// of the pairs a tally does not keep (dlq.TallyGroups).
				consumer, kind = "(others)", "(others)"
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\n", consumer, kind, k.Count, k.Replayable, formatTime(k.Last))
		}
		if len(rep.DeadLetters) == 0 {
			fmt.Fprintln(tw, "(none)")
		}
		_ = tw.Flush()
	}
	if len(rep.Lag) > 0 {
		fmt.Fprintln(a.stdout, "\nkafka lag:")
		tw = tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "TOPIC\tPARTITION\tCOMMITTED\tHIGH WATER\tLAG")
		for _, l := range rep.Lag {
			fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\n", l.Topic, l.Partition, l.Committed, l.HighWater, l.Lag)
		}
		_ = tw.Flush()
	}
	if o := rep.Outbox; o != nil {
		lag := "-"
		if !o.Status.OldestPending.IsZero() {
			lag = time.Since(o.Status.OldestPending).Round(time.Millisecond).String()
		}
		waiting := ""
		if o.Status.Waiting > 0 {
			waiting = fmt.Sprintf(", %d of them waiting behind a refused row of their key", o.Status.Waiting)
		}
		fmt.Fprintf(a.stdout, "\noutbox %s: %d pending (oldest %s ago%s), %d parked, %d sent and kept\n",
			o.Table, o.Status.Pending, lag, waiting, o.Status.Parked, o.Status.Sent)
		if len(o.Parked) > 0 {
			tw = tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "SEQ\tEVENT ID\tDESTINATION\tATTEMPTS\tPARKED\tLAST ERROR")
			for _, p := range o.Parked {
				dest := p.Topic
				if p.RoutingKey != "" {
					dest += " " + p.RoutingKey
				}
				// The event id is the application's, the error the
				// broker's: either may hold a line break or a control.
				fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%s\t%s\n", p.Seq, safe(p.EventID), safe(dest), p.Attempts, formatTime(p.ParkedAt), safe(p.LastError))
			}
			_ = tw.Flush()
		}
	}
	if len(rep.Queues) > 0 {
		fmt.Fprintln(a.stdout, "\nrabbitmq queues:")
		tw = tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "QUEUE\tREADY\tCONSUMERS")
		for _, q := range rep.Queues {
			fmt.Fprintf(tw, "%s\t%d\t%d\n", q.Queue, q.Ready, q.Consumers)
		}
		_ = tw.Flush()
	}
}

func (a *app) retention(ctx context.Context, args []string) error {
	fs, helpOnly := a.flags(ctx, "retention")
	db := a.dbFlagsOn(fs)
	name := fs.String("consumer", "", "the consumer `name` (required)")
	olderThan := fs.Duration("older-than", 0, "delete rows processed more than this `duration` ago (required, e.g. 720h)")
	batch := fs.Int("batch", 1000, "rows per statement")
	duty := fs.Float64("duty-cycle", 0.1, "the `share` of its time the sweep spends deleting, in (0, 1]; 1 does not pause")
	dry := fs.Bool("dry-run", false, "count the rows that would be deleted")
	asJSON := fs.Bool("json", false, "print the result as JSON")
	if helpOnly {
		return nil
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	switch {
	case *name == "":
		return usagef("-consumer is required")
	case *olderThan <= 0:
		return usagef("-older-than is required and must be positive")
	case *olderThan < time.Second:
		// As consumer.Config.Retention.MaxAge: a window this short
		// outlasts no redelivery (a typo for 1m or 1h, most likely).
		return usagef("-older-than %v is below 1s: the window must outlast the longest redelivery", *olderThan)
	case *batch <= 0:
		return usagef("-batch must be positive")
	case !(*duty > 0 && *duty <= 1):
		return usagef("-duty-cycle %v is not in (0, 1]", *duty)
	}
	pool, err := db.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	// The database's clock wrote the rows' processed_at: a cutoff of this
	// host's clock would move the window by the skew between the two.
	cutoff, err := dedup.Cutoff(ctx, pool, *olderThan)
	if err != nil {
		return err
	}
	var progress func(int64)
	if !*asJSON {
		progress = func(n int64) {
			if a.terminal {
				fmt.Fprintf(a.stderr, "\rdeleted %d rows", n)
			} else {
				fmt.Fprintf(a.stderr, "deleted %d rows\n", n)
			}
		}
	}
	n, err := inspect.Retention(ctx, pool, db.tables(), *name, cutoff, inspect.RetentionOptions{
		BatchSize: *batch, DryRun: *dry, Progress: progress, DutyCycle: *duty})
	if a.terminal && progress != nil && !*dry {
		fmt.Fprintln(a.stderr)
	}
	if err != nil && (*dry || n == 0) {
		// It counted nothing, or deleted nothing before it failed (its
		// first statement did) and checked no name: no report to print.
		// Rows deleted before a later failure are reported, theirs being
		// a consumer that has rows.
		return err
	}
	// A name with no rows at all (a typo, most often) deletes nothing, as
	// a consumer with no row old enough does: say so. Not an error: a
	// consumer idle for longer than the window has no rows either.
	known := true
	if err == nil && n == 0 {
		if has, herr := inspect.HasRows(ctx, pool, db.tables(), *name); herr == nil && !has {
			known = false
			a.warnNoRows(ctx, pool, db, *name)
		}
	}
	if *asJSON {
		if jerr := a.writeJSON(map[string]any{"consumer": *name, "cutoff": cutoff.UTC(), "deleted": n, "dry_run": *dry,
			"consumer_has_rows": known}); jerr != nil {
			return jerr
		}
	} else if *dry {
		fmt.Fprintf(a.stdout, "%s: %d rows processed before %s would be deleted\n", *name, n, cutoff.UTC().Format(time.RFC3339))
	} else {
		fmt.Fprintf(a.stdout, "%s: deleted %d rows processed before %s\n", *name, n, cutoff.UTC().Format(time.RFC3339))
	}
	return err
}
