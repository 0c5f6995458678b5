package dedup

import (
	"bytes"
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"math"
	"regexp"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/onceco/once/internal/migrate"
	"github.com/onceco/once/internal/pgtext"
)

// DefaultTable is the table name used when Config.Table is empty.
const DefaultTable = "processed_events"

// ErrInvalidName is wrapped by New's errors for a schema or table name that
// is not a plain SQL identifier.
var ErrInvalidName = errors.New("dedup: invalid identifier")

// Config names the store's tables.
type Config struct {
	// Schema holds the tables. Defaults to "": unqualified names, resolved
	// through the connection's search_path.
	Schema string
	// Table is the processed-events table; the attempts table is named
	// after it with the suffix "_attempts". Defaults to "processed_events".
	Table string
}

// DB is what the store needs of a connection: *pgxpool.Pool, *pgx.Conn and
// pgx.Tx all satisfy it.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Store claims event ids and deletes old claims. Build it with New.
type Store struct {
	names  schemaNames
	series *migrate.Series

	claimSQL, claimBatchSQL, lookupSQL, lookupManySQL string
	// claimBatchOneSourceSQL is claimBatchSQL for a batch whose claims
	// share their source and partition (a Kafka partition's, a RabbitMQ
	// queue's): those go as two values instead of two arrays.
	claimBatchOneSourceSQL             string
	retentionSQL, attemptsRetentionSQL string
}

// identifier is a plain, unquoted SQL identifier of at most 63 bytes minus
// room for the suffixes the store appends.
var identifier = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,47}$`)

// New validates cfg and prepares the store's statements. Names must match
// [A-Za-z_][A-Za-z0-9_]* and be at most 48 bytes long; anything else fails
// with an error wrapping ErrInvalidName that names the field.
func New(cfg Config) (*Store, error) {
	if cfg.Table == "" {
		cfg.Table = DefaultTable
	}
	if !identifier.MatchString(cfg.Table) {
		return nil, fmt.Errorf("%w: Table %q must match %s", ErrInvalidName, cfg.Table, identifier)
	}
	if cfg.Schema != "" && !identifier.MatchString(cfg.Schema) {
		return nil, fmt.Errorf("%w: Schema %q must match %s", ErrInvalidName, cfg.Schema, identifier)
	}
	names := newSchemaNames(cfg.Schema, cfg.Table)
	migs, err := loadMigrations(names)
	if err != nil {
		return nil, err
	}
	table, attempts := names.Table, names.Attempts
	cols := `consumer, event_id, fingerprint, source, partition, "offset"`
	s := &Store{
		names:    names,
		claimSQL: `INSERT INTO ` + table + ` (` + cols + `) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING`,
		// One statement claims the batch and reads what was there before:
		// rows go in in id order, so that concurrent batches sharing ids
		// take their row locks in one order and cannot deadlock (of an id
		// repeated in the batch, the first appearance's row goes in); the
		// join on p sees the table as it was when the statement began,
		// which is the previous row of every duplicate committed before.
		// Only ids the insert did not take are looked up there, and only
		// they come back: a claimed id has no previous row to read (most
		// ids, in a stream that is mostly new), the lookup cost an index
		// probe for each, and a row back for each cost reading it.
		claimBatchSQL: claimBatchStatement(table, cols,
			`unnest($2::text[], $3::bytea[], $4::text[], $5::integer[], $6::bigint[])
		WITH ORDINALITY AS u(id, fp, src, part, off, ord)`, `src, part`),
		claimBatchOneSourceSQL: claimBatchStatement(table, cols,
			`unnest($2::text[], $3::bytea[], $6::bigint[])
		WITH ORDINALITY AS u(id, fp, off, ord)`, `$4::text, $5::integer`),
		lookupSQL: `SELECT fingerprint, processed_at FROM ` + table + ` WHERE consumer = $1 AND event_id = $2`,
		// A statement of its own sees what other transactions committed
		// after the batch statement's snapshot (READ COMMITTED).
		lookupManySQL: `SELECT event_id, fingerprint, processed_at FROM ` + table + ` WHERE consumer = $1 AND event_id = ANY($2::text[])`,
		// The oldest rows first, from where the previous statement
		// stopped ($4): ORDER BY with LIMIT makes the planner walk the
		// (consumer, processed_at) index however many rows are expired
		// (a bare LIMIT is taken from a sequential scan when most are),
		// and the lower bound skips the index entries of rows already
		// deleted, so each statement costs the same however far the sweep
		// has gone. Rows at the bound itself are taken again (>=), so a
		// batch ending amid equal timestamps loses none. The DELETE
		// checks the conditions again: in a partitioned table each
		// partition has rows of every ctid, and only the consumer's
		// expired ones may go. Another partition's row of the same ctid
		// that is one goes with the batch, whatever its age: the next
		// bound is therefore the newest of the rows the walk chose
		// (doomed), not of those deleted, which would pass the expired
		// rows between the two and end the sweep with most of them left
		// (a table whose partitions hold rows of other ages at the same
		// ctids, as a load in id order or space reused after VACUUM
		// leaves them).
		retentionSQL: `WITH doomed AS (
	SELECT ctid, processed_at FROM ` + table + ` WHERE consumer = $1 AND processed_at < $2 AND processed_at >= $4
	ORDER BY processed_at LIMIT $3)
, gone AS (DELETE FROM ` + table + ` WHERE ctid IN (SELECT ctid FROM doomed)
	AND consumer = $1 AND processed_at < $2 AND processed_at >= $4 RETURNING 1)
SELECT (SELECT count(*) FROM gone), coalesce((SELECT max(processed_at) FROM doomed), $4)`,
		// By key: a row the crash guard updates meanwhile is checked
		// again, and kept. SKIP LOCKED passes over the record a consumer
		// deletes inside a handler's transaction (with the message's
		// effects), which stays locked until that transaction ends: the
		// sweep would wait for the handler, up to its timeout, holding the
		// rows it had already deleted meanwhile. A skipped row goes with
		// its message's effects, or at a later sweep. ARRAY(...) runs the
		// locking SELECT once, before the DELETE.
		attemptsRetentionSQL: `DELETE FROM ` + attempts + ` WHERE consumer = $1 AND last_seen < $2 AND event_id = ANY(ARRAY(SELECT event_id FROM ` + attempts +
			` WHERE consumer = $1 AND last_seen < $2 LIMIT $3 FOR UPDATE SKIP LOCKED))`,
	}
	s.series = s.newSeries(cfg.Schema, cfg.Table, migs)
	return s, nil
}

// ErrInvalidClaim is wrapped by the errors of Claim, ClaimBatch and
// QueueClaimBatch, and by PendingClaim.Result's, for a claim that no retry
// can store: an empty Consumer or EventID (every event without an id would
// be a duplicate of the first), a Consumer, EventID or Source that is
// not UTF-8 text or holds a NUL, which PostgreSQL's text type refuses, or a
// Consumer and EventID longer than MaxKeyLength bytes together, which the
// btree index of the (consumer, event_id) key may not hold.
// Nothing is sent for it, and the transaction stays usable. Treat it as the
// event's fault (dead-letter it), not as an outage.
var ErrInvalidClaim = errors.New("dedup: invalid claim")

// MaxKeyLength bounds a claim's Consumer and EventID, in bytes together.
// They are the key of the store's tables, whose btree index PostgreSQL
// refuses an entry of more than 2,704 bytes (8 kB pages), compressed if it
// compresses, on every try (SQLSTATE 54000). Any key of MaxKeyLength bytes
// fits, however little it compresses; a longer one is refused with
// ErrInvalidClaim, before any statement, rather than stored or not
// depending on its content.
const MaxKeyLength = 2600

// Claim is one event id to claim for a consumer.
type Claim struct {
	// Consumer is the consumer name, the scope of the id (rows of other
	// names are never compared).
	Consumer string
	// EventID is the id claimed; it may not be empty, nor longer than
	// MaxKeyLength bytes with Consumer.
	EventID string
	// Fingerprint of the payload, stored with the claim and compared on a
	// duplicate; nil stores none and disables the comparison.
	Fingerprint []byte
	// Source, Partition and Offset record where the event came from; a
	// negative Partition or Offset is stored as NULL.
	Source    string
	Partition int32
	Offset    int64
}

// validate returns an error wrapping ErrInvalidClaim when c cannot be
// stored (see ErrInvalidClaim).
func (c *Claim) validate() error {
	if err := validateConsumer(c.Consumer); err != nil {
		return err
	}
	return c.validateEvent()
}

// validateConsumer returns an error wrapping ErrInvalidClaim when a
// claim's Consumer cannot be stored.
func validateConsumer(consumer string) error {
	switch {
	case consumer == "":
		return fmt.Errorf("%w: empty Consumer", ErrInvalidClaim)
	case !pgtext.Storable(consumer):
		return fmt.Errorf("%w: Consumer is not UTF-8 text without NUL, which PostgreSQL cannot store", ErrInvalidClaim)
	}
	return nil
}

// validateEvent is validate without the checks of the Consumer alone,
// which the claims of a batch share.
func (c *Claim) validateEvent() error {
	switch {
	case c.EventID == "":
		return fmt.Errorf("%w: empty EventID", ErrInvalidClaim)
	case !pgtext.Storable(c.EventID):
		return fmt.Errorf("%w: EventID is not UTF-8 text without NUL, which PostgreSQL cannot store", ErrInvalidClaim)
	case !pgtext.Storable(c.Source):
		return fmt.Errorf("%w: Source is not UTF-8 text without NUL, which PostgreSQL cannot store", ErrInvalidClaim)
	case len(c.Consumer)+len(c.EventID) > MaxKeyLength:
		return fmt.Errorf("%w: Consumer and EventID are %d bytes long together, more than the %d the key's index holds", ErrInvalidClaim, len(c.Consumer)+len(c.EventID), MaxKeyLength)
	}
	return nil
}

// Outcome is what a claim found. The zero Outcome is none of the three:
// it is the Outcome of the Result returned with an error, which never
// reads as Claimed.
type Outcome int

const (
	// Claimed means the id is new; the row is inserted in the caller's
	// transaction and exists once that commits.
	Claimed Outcome = iota + 1
	// Duplicate means the id was processed before with the same fingerprint (or
	// one of the two has none).
	Duplicate
	// Conflict means the id was processed before with a different fingerprint.
	Conflict
)

// String returns "claimed", "duplicate" or "conflict", and
// "Outcome(n)" for a value that names no outcome (the zero Outcome).
func (o Outcome) String() string {
	switch o {
	case Claimed:
		return "claimed"
	case Duplicate:
		return "duplicate"
	case Conflict:
		return "conflict"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// Result is the outcome of one claim. For Duplicate and Conflict, Previous
// describes the row that was there. The zero Result, returned with every
// error, has the zero Outcome, which is not Claimed.
type Result struct {
	// Outcome is Claimed, Duplicate or Conflict; the zero Outcome with an
	// error.
	Outcome Outcome
	// Previous is the row found, for Duplicate and Conflict; zero for
	// Claimed.
	Previous Previous
}

// Previous is what the store knows of an id processed before.
type Previous struct {
	// Fingerprint is the one stored with the earlier claim; nil when it
	// stored none.
	Fingerprint []byte
	// ProcessedAt is when the earlier claim was made.
	ProcessedAt time.Time
}

// Claim inserts c's id in tx. When another transaction holds an uncommitted
// claim of the same id, Claim waits for it (the primary key serialises the
// two) and then reports Duplicate or Conflict if it committed, or claims
// the id itself if it rolled back. The lookup of the previous row costs a
// second statement only when the id is not new.
func (s *Store) Claim(ctx context.Context, tx DB, c Claim) (Result, error) {
	if err := c.validate(); err != nil {
		return Result{}, fmt.Errorf("dedup: claim: %w", err)
	}
	inserted, err := s.insert(ctx, tx, c)
	if err != nil {
		return Result{}, err
	}
	return s.claimResult(ctx, tx, c, inserted)
}

// insert sends claimSQL for c and reports whether the row went in.
func (s *Store) insert(ctx context.Context, tx DB, c Claim) (bool, error) {
	tag, err := tx.Exec(ctx, s.claimSQL, claimArgs(c)...)
	if err != nil {
		return false, fmt.Errorf("dedup: claim: %w", err)
	}
	return tag.RowsAffected() == 1, nil
}

// claimArgs are the arguments of claimSQL for c.
func claimArgs(c Claim) []any {
	return []any{c.Consumer, c.EventID, c.Fingerprint, c.Source, nullable32(c.Partition), nullable64(c.Offset)}
}

// claimResult finishes a claim whose insert (claimSQL, sent on tx) inserted
// the row or not: when it did not, it looks up the previous row, and claims
// again if retention removed that row in between.
func (s *Store) claimResult(ctx context.Context, tx DB, c Claim, inserted bool) (Result, error) {
	for try := 0; ; try++ {
		if inserted {
			return Result{Outcome: Claimed}, nil
		}
		var prev Previous
		err := tx.QueryRow(ctx, s.lookupSQL, c.Consumer, c.EventID).Scan(&prev.Fingerprint, &prev.ProcessedAt)
		if errors.Is(err, pgx.ErrNoRows) && try < 3 {
			// Retention deleted the row between the insert and the
			// lookup: the id is free again, claim it.
			if inserted, err = s.insert(ctx, tx, c); err != nil {
				return Result{}, err
			}
			continue
		}
		if err != nil {
			return Result{}, fmt.Errorf("dedup: claim lookup: %w", err)
		}
		return Result{Outcome: compare(c.Fingerprint, prev.Fingerprint), Previous: prev}, nil
	}
}

// errNotRead is the error of a pending claim whose statement's result was
// never read: the batch failed before it, or its results were read without
// BatchResults.Close running the callbacks.
var errNotRead = errors.New("the batch's result was not read")

// PendingClaim is a claim queued on a pgx.Batch by QueueClaim, whose
// outcome Result gives once the batch has run.
type PendingClaim struct {
	s        *Store
	c        Claim
	done     bool  // the statement's result was read
	err      error // the statement's error
	inserted bool
}

// QueueClaim queues on b the statement Claim would send for c, and returns
// the pending claim whose Result gives the outcome once b has been sent and
// its results read. Queue it after b.BeginTx, so that the transaction's
// BEGIN and the claim cost one round trip:
//
//	b := &pgx.Batch{}
//	b.BeginTx(pgx.TxOptions{})
//	pending := store.QueueClaim(b, c)
//	br := pool.SendBatch(ctx, b)
//	tx := br.Tx()
//	defer tx.Rollback(ctx)
//	if err := br.Close(); err != nil { ... }
//	res, err := pending.Result(ctx, tx)
//
// The claim's row belongs to the transaction the batch runs in, as with
// Claim. QueueClaim sends nothing; it sets the queued query's callback,
// which BatchResults.Close runs. c's Fingerprint must not be modified
// until b has been sent. A claim that cannot be stored (ErrInvalidClaim)
// queues nothing; Result returns the error.
func (s *Store) QueueClaim(b *pgx.Batch, c Claim) *PendingClaim {
	p := &PendingClaim{s: s, c: c}
	if err := c.validate(); err != nil {
		// Nothing queued: Result reports it.
		p.err = err
		return p
	}
	// Query rather than Exec: its callback runs (and sees the error) even
	// when the statement itself fails.
	b.Queue(s.claimSQL, claimArgs(c)...).Query(func(rows pgx.Rows) error {
		rows.Close()
		if err := rows.Err(); err != nil {
			p.err = err
			return err
		}
		p.inserted = rows.CommandTag().RowsAffected() == 1
		p.done = true
		return nil
	})
	return p
}

// Result returns the claim's outcome, as Claim would have. Call it after
// the batch's results were read (BatchResults.Close returned nil), with the
// transaction the batch ran in: for an id that is not new it sends one
// more statement on tx (the lookup of the previous row, and, when
// retention removed that row meanwhile, the claim again), exactly as Claim
// does; a new id costs nothing more.
//
// Result fails if the claim's statement failed (wrapping the statement's
// error), or if its result was never read: the batch failed before
// reaching it (a statement queued earlier failed, or, in the
// statement-caching query modes, preparing any statement of the batch
// failed; BatchResults.Close has the cause), or its results were read with
// BatchResults.Exec or Query instead of Close, which is what runs the
// callback QueueClaim set. It then never reports Claimed.
//
// Call Result once, from the goroutine that uses tx; a PendingClaim is not
// safe for concurrent use.
func (p *PendingClaim) Result(ctx context.Context, tx DB) (Result, error) {
	if p.err != nil {
		return Result{}, fmt.Errorf("dedup: claim: %w", p.err)
	}
	if !p.done {
		return Result{}, fmt.Errorf("dedup: claim: %w", errNotRead)
	}
	return p.s.claimResult(ctx, tx, p.c, p.inserted)
}

// ClaimBatch claims many ids for one consumer with one statement, and
// returns one Result per claim, in order. All claims must have the same
// Consumer. An id that appears twice in the batch is Claimed at its first
// appearance and a Duplicate or Conflict (against the first) afterwards.
// The same statement reads the previous rows of the duplicates; a second
// one reads, for all of them at once, the ids another transaction
// committed while the statement waited on them, and a claim of its own is
// sent only for an id retention deleted meanwhile.
func (s *Store) ClaimBatch(ctx context.Context, tx DB, claims []Claim) ([]Result, error) {
	if len(claims) == 0 {
		return nil, nil
	}
	sql, args, err := s.claimBatch(claims)
	if err != nil {
		return nil, err
	}
	rows, err := tx.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("dedup: claim batch: %w", err)
	}
	found := newBatchFound(len(claims))
	if err := found.scan(rows); err != nil {
		return nil, fmt.Errorf("dedup: claim batch: %w", err)
	}
	return s.batchResults(ctx, tx, claims, found)
}

// claimBatchStatement is the batch claim over the rows of unnest: with
// each claim's source and partition from it, or, srcPart being two
// parameters, the same for all.
func claimBatchStatement(table, cols, unnest, srcPart string) string {
	return `WITH u AS (
	SELECT * FROM ` + unnest + `
), ins AS (
	INSERT INTO ` + table + ` (` + cols + `)
	SELECT $1, id, fp, ` + srcPart + `, off FROM u ORDER BY id COLLATE "C", ord
	ON CONFLICT DO NOTHING RETURNING event_id
)
SELECT u.ord, p.fingerprint, p.processed_at
FROM u LEFT JOIN ins ON ins.event_id = u.id
LEFT JOIN LATERAL (
	SELECT fingerprint, processed_at FROM ` + table + `
	WHERE ins.event_id IS NULL AND consumer = $1 AND event_id = u.id OFFSET 0
) p ON true
WHERE ins.event_id IS NULL`
}

// claimBatch returns the statement and arguments that claim claims, which
// must be at least one, all of one consumer: claimBatchOneSourceSQL when
// they share their source and partition (every batch of a Kafka partition
// or a RabbitMQ queue), else claimBatchSQL.
func (s *Store) claimBatch(claims []Claim) (string, []any, error) {
	consumer, src, part := claims[0].Consumer, claims[0].Source, claims[0].Partition
	if err := validateConsumer(consumer); err != nil {
		return "", nil, fmt.Errorf("dedup: claim batch: %w", err)
	}
	oneSource := true
	for i := range claims {
		c := &claims[i]
		if c.Consumer != consumer {
			return "", nil, fmt.Errorf("dedup: claim batch: mixed consumers %q and %q", consumer, c.Consumer)
		}
		if err := c.validateEvent(); err != nil {
			return "", nil, fmt.Errorf("dedup: claim batch: %w", err)
		}
		oneSource = oneSource && c.Source == src && c.Partition == part
	}
	ids := make(ptrArray[textElem], len(claims))
	fps := make(ptrArray[byteaElem], len(claims))
	offs := make(ptrArray[pgtype.Int8], len(claims))
	for i, c := range claims {
		ids[i], fps[i] = textElem(c.EventID), c.Fingerprint
		offs[i] = pgtype.Int8{Int64: c.Offset, Valid: c.Offset >= 0}
	}
	if oneSource {
		return s.claimBatchOneSourceSQL, []any{consumer, ids, fps, src, pgtype.Int4{Int32: part, Valid: part >= 0}, offs}, nil
	}
	srcs := make(ptrArray[textElem], len(claims))
	parts := make(ptrArray[pgtype.Int4], len(claims))
	for i, c := range claims {
		srcs[i] = textElem(c.Source)
		parts[i] = pgtype.Int4{Int32: c.Partition, Valid: c.Partition >= 0}
	}
	return s.claimBatchSQL, []any{consumer, ids, fps, srcs, parts, offs}, nil
}

// ptrArray is a one-dimensional array argument whose elements pgx reads
// through pointers. A plain slice is encoded through pgtype.FlatArray,
// whose Index boxes each string, []byte or struct element into an
// interface: an allocation per element of every claim, where a pointer
// needs none. The pointer's type must be one pgx's codec encodes as it
// is (textElem, byteaElem, pgtype.Int8): for a *string or a *[]byte pgx
// dereferences the pointer through reflection, boxing the element again.
type ptrArray[T any] []T

// textElem is a text element of a ptrArray: pgx encodes a *textElem
// through its TextValue, with no allocation.
type textElem string

// TextValue implements pgtype.TextValuer.
func (e *textElem) TextValue() (pgtype.Text, error) {
	return pgtype.Text{String: string(*e), Valid: true}, nil
}

// byteaElem is a bytea element of a ptrArray (nil is NULL): pgx encodes a
// *byteaElem through its BytesValue, with no allocation.
type byteaElem []byte

// BytesValue implements pgtype.BytesValuer.
func (e *byteaElem) BytesValue() ([]byte, error) { return *e, nil }

// Dimensions implements pgtype.ArrayGetter.
func (a ptrArray[T]) Dimensions() []pgtype.ArrayDimension {
	if a == nil {
		return nil
	}
	return []pgtype.ArrayDimension{{Length: int32(len(a)), LowerBound: 1}}
}

// Index implements pgtype.ArrayGetter.
func (a ptrArray[T]) Index(i int) any { return &a[i] }

// IndexType implements pgtype.ArrayGetter.
func (a ptrArray[T]) IndexType() any { return new(T) }

// Value hands pgx the plain slice where it does not know the parameter's
// type (QueryExecModeExec, the simple protocol, as behind PgBouncer): it
// finds the array type from the slice there, boxing each element as
// before, the elements as the plain types it knows (string, []byte).
// Where it knows the type it uses the pointers.
func (a ptrArray[T]) Value() (driver.Value, error) {
	switch v := any(a).(type) {
	case ptrArray[textElem]:
		out := make([]string, len(v))
		for i, e := range v {
			out[i] = string(e)
		}
		return out, nil
	case ptrArray[byteaElem]:
		out := make([][]byte, len(v))
		for i, e := range v {
			out[i] = e
		}
		return out, nil
	}
	return []T(a), nil
}

// batchFound is what claimBatchSQL returned, by claim: whether its row
// went in, and the row that was there before.
type batchFound struct {
	inserted []bool
	before   []*Previous
}

// newBatchFound returns what n claims found before claimBatchSQL's rows
// are read: every row went in. The statement returns a row only for the
// claims whose row did not (a duplicate is the exception in a stream), so
// a batch of new ids costs no result rows.
func newBatchFound(n int) *batchFound {
	f := &batchFound{inserted: make([]bool, n), before: make([]*Previous, n)}
	for i := range f.inserted {
		f.inserted[i] = true
	}
	return f
}

// scan reads claimBatchSQL's rows, and closes them.
func (f *batchFound) scan(rows pgx.Rows) error {
	n := int64(len(f.inserted))
	var (
		ord    int64
		fp     []byte
		procAt *time.Time
	)
	_, err := pgx.ForEachRow(rows, []any{&ord, &fp, &procAt}, func() error {
		k := ord - 1
		if k < 0 || k >= n {
			return fmt.Errorf("row for ordinal %d of %d", ord, n)
		}
		f.inserted[k] = false
		if procAt != nil {
			f.before[k] = &Previous{Fingerprint: bytes.Clone(fp), ProcessedAt: *procAt}
		}
		return nil
	})
	return err
}

// batchResults turns what claimBatchSQL found into one Result per claim,
// claiming on tx, one by one, the ids it found neither inserted nor there
// before.
func (s *Store) batchResults(ctx context.Context, tx DB, claims []Claim, found *batchFound) ([]Result, error) {
	results := make([]Result, len(claims))
	now := time.Now()
	first := make(map[string]int, len(claims)) // id -> its claimed appearance
	var missing []int
	for i, c := range claims {
		if k, dup := first[c.EventID]; dup {
			// A later appearance of an id claimed earlier in this batch.
			p := Previous{Fingerprint: claims[k].Fingerprint, ProcessedAt: now}
			results[i] = Result{Outcome: compare(c.Fingerprint, p.Fingerprint), Previous: p}
			continue
		}
		switch {
		case found.inserted[i]:
			first[c.EventID] = i
			results[i].Outcome = Claimed
		case found.before[i] != nil:
			results[i] = Result{Outcome: compare(c.Fingerprint, found.before[i].Fingerprint), Previous: *found.before[i]}
		default:
			// Committed by another transaction after this statement's
			// snapshot was taken, or deleted by retention meanwhile.
			missing = append(missing, i)
		}
	}
	if len(missing) == 0 {
		return results, nil
	}
	prev, err := s.lookupMany(ctx, tx, claims[0].Consumer, claims, missing)
	if err != nil {
		return nil, err
	}
	for _, i := range missing {
		if p, ok := prev[claims[i].EventID]; ok {
			results[i] = Result{Outcome: compare(claims[i].Fingerprint, p.Fingerprint), Previous: p}
			continue
		}
		// Deleted by retention meanwhile: the id is free again.
		if results[i], err = s.Claim(ctx, tx, claims[i]); err != nil {
			return nil, err
		}
	}
	return results, nil
}

// lookupMany reads, in one statement, the rows of the claims at the
// indexes missing: ids another transaction committed while the batch
// statement waited for them (a copy in a concurrent batch), which that
// statement's snapshot could not see.
func (s *Store) lookupMany(ctx context.Context, tx DB, consumer string, claims []Claim, missing []int) (map[string]Previous, error) {
	ids := make([]string, len(missing))
	for k, i := range missing {
		ids[k] = claims[i].EventID
	}
	rows, err := tx.Query(ctx, s.lookupManySQL, consumer, ids)
	if err != nil {
		return nil, fmt.Errorf("dedup: claim lookup: %w", err)
	}
	prev := make(map[string]Previous, len(missing))
	var (
		id string
		p  Previous
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &p.Fingerprint, &p.ProcessedAt}, func() error {
		prev[id] = Previous{Fingerprint: bytes.Clone(p.Fingerprint), ProcessedAt: p.ProcessedAt}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("dedup: claim lookup: %w", err)
	}
	return prev, nil
}

// PendingClaimBatch is a batch of claims queued on a pgx.Batch by
// QueueClaimBatch, whose outcomes Results gives once the batch has run.
type PendingClaimBatch struct {
	s      *Store
	claims []Claim
	found  *batchFound
	done   bool  // the statement's result was read
	err    error // the statement's error
}

// QueueClaimBatch queues on b the one statement ClaimBatch would send for
// claims, and returns the pending batch whose Results gives the outcomes
// once b has been sent and its results read. Queue it after b.BeginTx, so
// that the transaction's BEGIN and the claims cost one round trip (see
// QueueClaim). The claims' rows belong to the transaction the batch runs
// in, as with ClaimBatch.
//
// Like ClaimBatch, it fails for claims of more than one consumer, or with
// a claim that cannot be stored (ErrInvalidClaim); it then queues nothing. An empty claims slice queues nothing either, and its
// Results are nil. QueueClaimBatch sends nothing; it sets the queued
// query's callback, which BatchResults.Close runs. claims (and their
// fingerprints) must not be modified until Results has returned.
func (s *Store) QueueClaimBatch(b *pgx.Batch, claims []Claim) (*PendingClaimBatch, error) {
	p := &PendingClaimBatch{s: s, claims: claims}
	if len(claims) == 0 {
		p.done = true
		return p, nil
	}
	sql, args, err := s.claimBatch(claims)
	if err != nil {
		return nil, err
	}
	p.found = newBatchFound(len(claims))
	b.Queue(sql, args...).Query(func(rows pgx.Rows) error {
		if err := p.found.scan(rows); err != nil {
			p.err = err
			return err
		}
		p.done = true
		return nil
	})
	return p, nil
}

// Results returns one Result per claim, in order, as ClaimBatch would
// have. Call it after the batch's results were read (BatchResults.Close
// returned nil), with the transaction the batch ran in: for an id that
// ClaimBatch would have claimed again one by one (committed by another
// transaction while the statement ran, or removed by retention meanwhile),
// it sends the statements of Claim on tx; otherwise it sends nothing.
//
// Results fails if the claims' statement failed (wrapping the statement's
// error), or if its result was never read: the batch failed before
// reaching it (see PendingClaim.Result), or its results were read with
// BatchResults.Exec or Query instead of Close, which is what runs the
// callback QueueClaimBatch set. It then returns no results.
//
// Call Results once, from the goroutine that uses tx; a PendingClaimBatch
// is not safe for concurrent use.
func (p *PendingClaimBatch) Results(ctx context.Context, tx DB) ([]Result, error) {
	if p.err != nil {
		return nil, fmt.Errorf("dedup: claim batch: %w", p.err)
	}
	if !p.done {
		return nil, fmt.Errorf("dedup: claim batch: %w", errNotRead)
	}
	if len(p.claims) == 0 {
		return nil, nil
	}
	return p.s.batchResults(ctx, tx, p.claims, p.found)
}

func compare(fp, prev []byte) Outcome {
	if fp == nil || prev == nil || bytes.Equal(fp, prev) {
		return Duplicate
	}
	return Conflict
}

// DeleteOlderThan removes consumer's processed-event rows and attempt
// counts older than cutoff, batchSize rows per statement, each statement
// its own short transaction, so no lock is held for long; rows of other
// consumers sharing the table are left alone, whatever their age. It
// returns the number of processed-event rows removed, and stops early with
// ctx's error. batchSize <= 0 means 1000; an empty consumer, or one that
// is not UTF-8 text without NUL, is an error, returned before any
// statement. An attempt count that an open transaction holds (a consumer
// deletes a message's count in its handler's transaction) is passed over,
// not waited for: it goes with that transaction, or at a later sweep.
// The (consumer, processed_at) index of schema version 2 keeps each
// statement to the rows it deletes.
//
// processed_at is written by the database's clock: take cutoff from
// Cutoff, not from this host's time.Now().
//
// Once a row is gone, a redelivery of its event is handled again: the
// retention window must be longer than the longest time a message can take
// to be redelivered (Kafka topic retention when a group may rewind, AMQP
// message TTL, the longest outage you plan to replay after).
//
// Options: DutyCycle paces the sweep so that it leaves the database to the
// consumers most of the time; Progress reports the rows removed so far.
func (s *Store) DeleteOlderThan(ctx context.Context, db DB, consumer string, cutoff time.Time, batchSize int, opts ...RetentionOption) (int64, error) {
	if consumer == "" {
		return 0, errors.New("dedup: retention: empty consumer name")
	}
	if !pgtext.Storable(consumer) {
		return 0, errors.New("dedup: retention: consumer name is not UTF-8 text without NUL, which PostgreSQL cannot store")
	}
	if batchSize <= 0 {
		batchSize = 1000
	}
	o := retentionOptions{share: 1}
	for _, opt := range opts {
		opt(&o)
	}
	if !(o.share > 0 && o.share <= 1) {
		return 0, fmt.Errorf("dedup: retention: DutyCycle %v is not in (0, 1]", o.share)
	}
	total, err := deleteOldestFirst(ctx, db, s.retentionSQL, consumer, cutoff, batchSize, o)
	if err != nil {
		return total, err
	}
	_, err = deleteInBatches(ctx, db, s.attemptsRetentionSQL, consumer, cutoff, batchSize, o.share)
	return total, err
}

// Cutoff returns the database's clock (now() of db's session) less
// maxAge: the cutoff for DeleteOlderThan that keeps every row processed
// within maxAge. A row's processed_at is written by the database's clock,
// so a cutoff taken from the application's clock would move the window by
// the skew between the two hosts: a host clock ahead of the database's
// deletes rows younger than maxAge, and a redelivery of their events is
// handled again. maxAge must be positive.
func Cutoff(ctx context.Context, db DB, maxAge time.Duration) (time.Time, error) {
	if maxAge <= 0 {
		return time.Time{}, fmt.Errorf("dedup: retention: age %v is not positive", maxAge)
	}
	var cutoff time.Time
	if err := db.QueryRow(ctx, `SELECT now() - $1::bigint * interval '1 microsecond'`, maxAge.Microseconds()).Scan(&cutoff); err != nil {
		return time.Time{}, fmt.Errorf("dedup: retention: the database's clock: %w", err)
	}
	return cutoff, nil
}

// RetentionOption adjusts DeleteOlderThan.
type RetentionOption func(*retentionOptions)

type retentionOptions struct {
	share    float64
	progress func(deleted int64)
}

// Progress has DeleteOlderThan call fn after each statement on the
// processed-events table, with the number of its rows removed so far, from
// the goroutine that called DeleteOlderThan.
func Progress(fn func(deleted int64)) RetentionOption {
	return func(o *retentionOptions) { o.progress = fn }
}

// DutyCycle paces a retention sweep: after a statement that took d,
// DeleteOlderThan waits d × (1 − share) / share before the next, so that it
// spends at most share of its time deleting and leaves the rest to the
// consumers writing to the same table and indexes. share must be in
// (0, 1]; 1, the default, does not wait. A sweep that deletes at r rows/s
// at full speed deletes at about share × r: keep that above the rate at
// which rows are claimed, or retention falls behind.
func DutyCycle(share float64) RetentionOption {
	return func(o *retentionOptions) { o.share = share }
}

// pauseAfter is the wait, under a duty cycle of share, after a statement
// that took took.
func pauseAfter(took time.Duration, share float64) time.Duration {
	if share >= 1 {
		return 0
	}
	wait := float64(took) * (1 - share) / share
	if wait >= math.MaxInt64 {
		// Past what a Duration holds (a share of 1e-10 after a 1 s
		// statement): the conversion would wrap round to no pause at all.
		return math.MaxInt64
	}
	return time.Duration(wait)
}

// pace waits pauseAfter(took, share), or until ctx ends.
func pace(ctx context.Context, took time.Duration, share float64) error {
	wait := pauseAfter(took, share)
	if wait <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// deleteOldestFirst runs the retention statement of processed_events until
// a statement deletes fewer than batchSize rows, each from where the
// previous one stopped.
func deleteOldestFirst(ctx context.Context, db DB, sql, consumer string, cutoff time.Time, batchSize int, o retentionOptions) (int64, error) {
	var total int64
	from := pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}
	for {
		var n int64
		start := time.Now()
		if err := db.QueryRow(ctx, sql, consumer, cutoff, batchSize, from).Scan(&n, &from); err != nil {
			return total, fmt.Errorf("dedup: retention: %w", err)
		}
		total += n
		if o.progress != nil {
			o.progress(total)
		}
		if n < int64(batchSize) {
			return total, nil
		}
		if err := pace(ctx, time.Since(start), o.share); err != nil {
			return total, err
		}
	}
}

func deleteInBatches(ctx context.Context, db DB, sql, consumer string, cutoff time.Time, batchSize int, share float64) (int64, error) {
	var total int64
	for {
		start := time.Now()
		tag, err := db.Exec(ctx, sql, consumer, cutoff, batchSize)
		if err != nil {
			return total, fmt.Errorf("dedup: retention: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batchSize) {
			return total, nil
		}
		if err := pace(ctx, time.Since(start), share); err != nil {
			return total, err
		}
	}
}

func nullable32(v int32) *int32 {
	if v < 0 {
		return nil
	}
	return &v
}

func nullable64(v int64) *int64 {
	if v < 0 {
		return nil
	}
	return &v
}
