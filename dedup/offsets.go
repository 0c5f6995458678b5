package dedup

import (
	"github.com/onceco/once/internal/pgshape"
	"github.com/onceco/once/internal/pgtext"

	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Kafka offsets kept in PostgreSQL (the source's Config.OffsetsInDatabase):
// the table named after the processed-events table with the suffix
// "_offsets" holds one row per consumer and partition. Its progress is
// written in the transaction that commits the claims and the handlers'
// effects, so that the two cannot disagree: the row says which records are
// done, whatever the group's committed offsets say.

// ErrFenced is returned (wrapped) by RecordOffsets when the partition's
// row carries a newer epoch than the writer's: another owner took the
// partition over (TakeOverPartitions) since the writer did. The writer's
// transaction must roll back, and its records are left to the new owner.
var ErrFenced = errors.New("dedup: partition taken over by a newer owner")

// ErrInvalidOffsets is wrapped by the errors of TakeOverPartitions,
// RecordOffsets and OffsetDone for input no retry can store: an empty
// consumer name, a consumer, topic, topic id or group that is not UTF-8
// text or holds a NUL (PostgreSQL's text refuses it), an empty topic, a
// consumer and topic longer than MaxKeyLength bytes together (the
// offsets table's key), or a partition named twice in one take-over
// (one statement cannot take a row over twice). Nothing is sent for it,
// and the caller's transaction stays usable. It is the caller's mistake,
// not an outage.
var ErrInvalidOffsets = errors.New("dedup: invalid offsets input")

// PartitionKey names one partition of a topic.
type PartitionKey struct {
	Topic     string
	Partition int32
	// TopicID is the topic's id (Kafka 2.8 and later), "" when the cluster
	// has none. A row recorded under another topic id belongs to a deleted
	// topic of the same name and is started afresh.
	TopicID string
}

// Owner is who takes partitions over: the Kafka consumer group and its
// generation, recorded for diagnosis (fencing does not rely on them).
type Owner struct {
	Group      string
	Generation int32
}

// PartitionOffsets is what the offsets table says of a partition, as
// TakeOverPartitions returns it.
type PartitionOffsets struct {
	PartitionKey
	// Next is the offset below which every record is done; -1 when the
	// table knows nothing of the partition (a new row): the group's
	// committed offset then applies.
	Next int64
	// Done are offsets at or above Next that are done too, ascending.
	Done []int64
	// Epoch fences the new owner's writes: RecordOffsets with it fails with
	// ErrFenced once a later owner took the partition over.
	Epoch int64
}

// OffsetsTable returns the qualified, quoted name of the offsets table
// (Config.Table with the suffix "_offsets"), for use in SQL text.
func (s *Store) OffsetsTable() string { return s.names.Offsets }

// TakeOverPartitions makes the caller the owner of parts for consumer: in
// one statement it creates the missing rows and raises every row's epoch,
// waiting for the transactions of a previous owner that hold a row, and
// returns what the rows say, in the order of parts. A row recorded under
// another topic id than the part's is started afresh (Next -1). From then
// on a previous owner's RecordOffsets fails with ErrFenced. Input no
// statement can take (a partition named twice, a consumer name the claims
// refuse) fails with ErrInvalidOffsets before any is sent.
func (s *Store) TakeOverPartitions(ctx context.Context, db DB, consumer string, owner Owner, parts []PartitionKey) ([]PartitionOffsets, error) {
	if err := validateTakeOver(consumer, owner, parts); err != nil {
		return nil, err
	}
	if len(parts) == 0 {
		return nil, nil
	}
	topics := make([]string, len(parts))
	partitions := make([]int32, len(parts))
	ids := make([]string, len(parts))
	for i, p := range parts {
		topics[i], partitions[i], ids[i] = p.Topic, p.Partition, p.TopicID
	}
	rows, err := db.Query(ctx, s.takeOverSQL(), consumer, topics, partitions, ids, owner.Group, owner.Generation)
	if err != nil {
		return nil, fmt.Errorf("dedup: taking partitions over: %w", err)
	}
	// By topic and partition: the row keeps its topic id where the part's
	// is unknown.
	type topicPartition struct {
		topic     string
		partition int32
	}
	got := map[topicPartition]PartitionOffsets{}
	var o PartitionOffsets
	_, err = pgx.ForEachRow(rows, []any{&o.Topic, &o.Partition, &o.Next, &o.Done, &o.Epoch}, func() error {
		o.Done = slices.Clone(o.Done)
		got[topicPartition{o.Topic, o.Partition}] = o
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("dedup: taking partitions over: %w", err)
	}
	out := make([]PartitionOffsets, len(parts))
	for i, p := range parts {
		r, ok := got[topicPartition{p.Topic, p.Partition}]
		if !ok {
			return nil, fmt.Errorf("dedup: taking partitions over: no row returned for %s/%d", p.Topic, p.Partition)
		}
		r.PartitionKey = p
		out[i] = r
	}
	return out, nil
}

// validateTakeOver returns an error wrapping ErrInvalidOffsets when the
// take-over of parts cannot be sent (see ErrInvalidOffsets).
func validateTakeOver(consumer string, owner Owner, parts []PartitionKey) error {
	if err := validateOffsetsConsumer(consumer); err != nil {
		return err
	}
	if !pgtext.Storable(owner.Group) {
		return fmt.Errorf("%w: Owner.Group is not UTF-8 text without NUL, which PostgreSQL cannot store", ErrInvalidOffsets)
	}
	type topicPartition struct {
		topic     string
		partition int32
	}
	seen := make(map[topicPartition]bool, len(parts))
	for _, p := range parts {
		if err := validatePartitionKey(consumer, p); err != nil {
			return err
		}
		k := topicPartition{p.Topic, p.Partition}
		if seen[k] {
			return fmt.Errorf("%w: partition %s/%d named twice", ErrInvalidOffsets, p.Topic, p.Partition)
		}
		seen[k] = true
	}
	return nil
}

// validateOffsetsConsumer returns an error wrapping ErrInvalidOffsets when
// consumer cannot be stored, as Claim refuses it.
func validateOffsetsConsumer(consumer string) error {
	switch {
	case consumer == "":
		return fmt.Errorf("%w: empty consumer name", ErrInvalidOffsets)
	case !pgtext.Storable(consumer):
		return fmt.Errorf("%w: consumer name is not UTF-8 text without NUL, which PostgreSQL cannot store", ErrInvalidOffsets)
	}
	return nil
}

// validatePartitionKey returns an error wrapping ErrInvalidOffsets when
// consumer, or p under consumer's rows, cannot be stored.
func validatePartitionKey(consumer string, p PartitionKey) error {
	if err := validateOffsetsConsumer(consumer); err != nil {
		return err
	}
	switch {
	case p.Topic == "":
		return fmt.Errorf("%w: empty topic", ErrInvalidOffsets)
	case !pgtext.Storable(p.Topic):
		return fmt.Errorf("%w: topic %q is not UTF-8 text without NUL, which PostgreSQL cannot store", ErrInvalidOffsets, p.Topic)
	case !pgtext.Storable(p.TopicID):
		return fmt.Errorf("%w: topic id of %q is not UTF-8 text without NUL, which PostgreSQL cannot store", ErrInvalidOffsets, p.Topic)
	case len(consumer)+len(p.Topic) > MaxKeyLength:
		return fmt.Errorf("%w: consumer name and topic are %d bytes long together, more than the %d the key's index holds", ErrInvalidOffsets, len(consumer)+len(p.Topic), MaxKeyLength)
	}
	return nil
}

// anotherTopic is true in takeOverSQL when the row was recorded for
// another topic of the same name: both ids are known and differ. An
// unknown id ("": a cluster, or a Sarama.Version, without topic ids) says
// nothing of the topic: the row's progress is kept, and its known id too.
const anotherTopic = `o.topic_id <> '' AND excluded.topic_id <> '' AND o.topic_id <> excluded.topic_id`

// takeOverSQL inserts or raises the rows in the order of the primary key,
// so that two owners taking overlapping partitions cannot deadlock.
func (s *Store) takeOverSQL() string {
	return `INSERT INTO ` + s.names.Offsets + ` AS o (consumer, topic, partition, topic_id, kafka_group, generation)
SELECT $1, t, p, id, $5, $6 FROM unnest($2::text[], $3::integer[], $4::text[]) AS u(t, p, id)
ORDER BY t COLLATE "C", p
ON CONFLICT (consumer, topic, partition) DO UPDATE SET
	epoch = o.epoch + 1,
	next_offset = CASE WHEN ` + anotherTopic + ` THEN -1 ELSE o.next_offset END,
	done = CASE WHEN ` + anotherTopic + ` THEN '{}' ELSE o.done END,
	topic_id = CASE WHEN excluded.topic_id = '' THEN o.topic_id ELSE excluded.topic_id END,
	kafka_group = excluded.kafka_group,
	generation = excluded.generation,
	updated_at = now()
RETURNING topic, partition, next_offset, done, epoch`
}

// OffsetsUpdate is the progress of one partition that RecordOffsets
// writes.
type OffsetsUpdate struct {
	Topic     string
	Partition int32
	// Epoch is the writer's, from TakeOverPartitions.
	Epoch int64
	// DoneBelow is an offset below which the writer knows every record is
	// done (their transactions committed); -1 when it knows none. The row's
	// Next never moves back.
	DoneBelow int64
	// Done are the offsets this transaction finishes.
	Done []int64
}

// RecordOffsets adds u to the partition's row in tx: the offsets of u.Done
// join the row's done set, and Next moves past every offset below which all
// are done. Run it in the transaction that makes the records' effects
// durable, just before its commit: transactions of one partition take the
// row's lock in turn, each on the row as the one before committed it. It
// fails with an error wrapping ErrFenced when the row's epoch is not
// u.Epoch (a newer owner took the partition over, or the row is gone).
func (s *Store) RecordOffsets(ctx context.Context, tx DB, consumer string, u OffsetsUpdate) error {
	if err := validatePartitionKey(consumer, PartitionKey{Topic: u.Topic}); err != nil {
		return err
	}
	tag, err := tx.Exec(ctx, s.recordOffsetsSQL(), consumer, u.Topic, u.Partition, u.Epoch, u.DoneBelow, u.Done)
	if err != nil {
		return fmt.Errorf("dedup: recording offsets of %s/%d: %w", u.Topic, u.Partition, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: %s/%d, epoch %d", ErrFenced, u.Topic, u.Partition, u.Epoch)
	}
	return nil
}

// recordOffsetsSQL merges the done offsets into the row and moves
// next_offset over the run of consecutive done offsets that starts at it:
// in ascending order, the offsets o_i of that run are those with
// o_i - i = next_offset - 1 (i counted from 1). The row is locked first
// (FOR UPDATE), so the merge reads the version the previous writer
// committed.
func (s *Store) recordOffsetsSQL() string {
	return `WITH cur AS (
	SELECT greatest(next_offset, $5::bigint) AS n, done FROM ` + s.names.Offsets + `
	WHERE consumer = $1 AND topic = $2 AND partition = $3 AND epoch = $4
	FOR UPDATE
), s AS (
	SELECT DISTINCT o FROM cur, unnest(cur.done || $6::bigint[]) AS o WHERE o >= cur.n
), r AS (
	SELECT o, o - row_number() OVER (ORDER BY o) AS g FROM s
), adv AS (
	SELECT cur.n + (SELECT count(*) FROM r WHERE r.g = cur.n - 1) AS n FROM cur
)
UPDATE ` + s.names.Offsets + ` SET
	next_offset = adv.n,
	done = coalesce((SELECT array_agg(o ORDER BY o) FROM s WHERE o >= adv.n), '{}'),
	updated_at = now()
FROM adv
WHERE consumer = $1 AND topic = $2 AND partition = $3 AND epoch = $4`
}

// OffsetDone reports whether consumer's row of key's partition records the
// record at offset done: below the row's next offset, or in its done set.
// A row recorded under another known topic id than key's is of a deleted
// topic of the same name, and records nothing done for key's. No row: not
// done.
func (s *Store) OffsetDone(ctx context.Context, db DB, consumer string, key PartitionKey, offset int64) (bool, error) {
	if err := validatePartitionKey(consumer, key); err != nil {
		return false, err
	}
	var done bool
	err := db.QueryRow(ctx, `SELECT EXISTS (SELECT FROM `+s.names.Offsets+`
WHERE consumer = $1 AND topic = $2 AND partition = $3
	AND NOT (topic_id <> '' AND $4 <> '' AND topic_id <> $4)
	AND (next_offset > $5 OR $5 = ANY (done)))`,
		consumer, key.Topic, key.Partition, key.TopicID, offset).Scan(&done)
	if err != nil {
		return false, fmt.Errorf("dedup: reading the offsets of %s/%d: %w", key.Topic, key.Partition, err)
	}
	return done, nil
}

var offsetsColumns = pgshape.Cols(
	"consumer", "text", "topic", "text", "partition", "integer",
	"next_offset", "bigint", "done", "bigint[]", "epoch", "bigint",
	"topic_id", "text", "kafka_group", "text", "generation", "integer",
	"updated_at", "timestamp with time zone",
)

// takeOverDefaulted are the columns TakeOverPartitions leaves out of a new
// row for their defaults to fill. It reads next_offset and epoch back, so
// those need a default even where they take NULL; done and updated_at need
// one where they refuse it.
var takeOverDefaulted = []string{"next_offset", "done", "epoch", "updated_at"}

// CheckOffsets verifies that the offsets table exists with the columns it
// needs, a default for each that a take-over leaves out and reads back or
// that refuses NULL (next_offset, epoch; done, updated_at), and a primary
// key or unique index on (consumer, topic, partition), the conflict target
// of TakeOverPartitions. Check leaves it out, so that
// a schema managed by other tools needs it only where a source keeps
// offsets in the database; such a source runs CheckOffsets when it starts. It returns nil or an error
// wrapping ErrSchemaMismatch that names every difference.
func (s *Store) CheckOffsets(ctx context.Context, db DB) error {
	have, err := pgshape.Columns(ctx, db, s.names.Offsets)
	if err != nil {
		return fmt.Errorf("dedup: checking %s: %w", s.names.Offsets, err)
	}
	if have == nil {
		return fmt.Errorf("%w: %s does not exist: run Store.Migrate (schema version 4), or apply dedup/migrations",
			ErrSchemaMismatch, s.names.Offsets)
	}
	diffs := pgshape.Diffs(have, offsetsColumns, "the store")
	for _, name := range takeOverDefaulted {
		if h, ok := have[name]; ok && !h.Default && (h.NotNull || name == "next_offset" || name == "epoch") {
			diffs = append(diffs, fmt.Sprintf("column %s has no default: a take-over leaves it out for one to fill, "+
				"and without it the new row is refused, or its NULL cannot be read back", name))
		}
	}
	if h, ok := have["next_offset"]; ok && h.Default {
		def, err := columnDefault(ctx, db, s.names.Offsets, "next_offset")
		if err != nil {
			return fmt.Errorf("dedup: checking %s: %w", s.names.Offsets, err)
		}
		if !isMinusOne(def) {
			diffs = append(diffs, fmt.Sprintf("column next_offset's default is %s, want -1: a new row takes it for its position, "+
				"and anything but -1 (the table knows nothing of the partition) moves the group there, past its committed offset", def))
		}
	}
	unique, err := hasUniqueKey(ctx, db, s.names.Offsets, "consumer", "topic", "partition")
	if err != nil {
		return fmt.Errorf("dedup: checking %s: %w", s.names.Offsets, err)
	}
	if !unique {
		diffs = append(diffs, "no primary key or unique index on (consumer, topic, partition)")
	}
	if len(diffs) > 0 {
		return fmt.Errorf("%w: %s: %v", ErrSchemaMismatch, s.names.Offsets, diffs)
	}
	return nil
}

// columnDefault returns the default expression of table's column, as
// pg_get_expr gives it back ("" for none).
func columnDefault(ctx context.Context, db DB, table, column string) (string, error) {
	var def string
	err := db.QueryRow(ctx, `SELECT coalesce((SELECT pg_get_expr(d.adbin, d.adrelid)
FROM pg_attrdef d JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
WHERE d.adrelid = to_regclass($1) AND a.attname = $2), '')`, table, column).Scan(&def)
	return def, err
}

// isMinusOne reports whether a default expression is the constant -1 as
// PostgreSQL gives it back ('-1'::integer, '-1'::bigint, -1): the cast,
// quotes and parentheses aside. Any other expression, even one that
// yields -1, is refused: the check cannot run it.
func isMinusOne(def string) bool {
	def = strings.NewReplacer(" ", "", "(", "", ")", "", "'", "", "::bigint", "", "::integer", "").Replace(def)
	return def == "-1"
}

// offsetsPrivileges are the privileges on the offsets table that
// TakeOverPartitions (INSERT ... ON CONFLICT DO UPDATE ... RETURNING),
// RecordOffsets (SELECT ... FOR UPDATE, UPDATE) and OffsetDone (SELECT)
// need.
var offsetsPrivileges = []string{"SELECT", "INSERT", "UPDATE"}

// CheckOffsetsPrivileges verifies that the role of db's session (the
// current_user) has the privileges on the offsets table that a source
// keeping offsets in the database needs: SELECT, INSERT and UPDATE, on the
// table or on each of its columns. It returns nil, or an error naming the
// role, the table and every privilege missing: PostgreSQL would refuse the
// source's statements (SQLSTATE 42501) on every attempt. Run it after
// CheckOffsets (it fails when the table does not exist). It sends one
// query and is safe for concurrent use.
func (s *Store) CheckOffsetsPrivileges(ctx context.Context, db DB) error {
	cols := make([]string, len(offsetsColumns))
	for i, c := range offsetsColumns {
		cols[i] = c.Name
	}
	var (
		role    string
		missing []string
	)
	err := db.QueryRow(ctx, `SELECT current_user::text, coalesce(array_agg(p ORDER BY o), '{}')
FROM unnest($2::text[]) WITH ORDINALITY AS u(p, o)
WHERE NOT (SELECT bool_and(has_column_privilege($1::text::regclass, c, p)) FROM unnest($3::text[]) AS c)`,
		s.names.Offsets, offsetsPrivileges, cols).Scan(&role, &missing)
	if err != nil {
		return fmt.Errorf("dedup: checking the privileges on %s: %w", s.names.Offsets, err)
	}
	if len(missing) > 0 {
		return fmt.Errorf("dedup: the database role %q lacks %s on %s, which a source keeping its offsets in the database needs (SELECT, INSERT and UPDATE): GRANT %s ON %s TO %s",
			role, strings.Join(missing, " and "), s.names.Offsets, strings.Join(missing, ", "), s.names.Offsets, pgx.Identifier{role}.Sanitize())
	}
	return nil
}
