package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/backoff"
)

// Offsets stored outside Kafka (Config.OffsetsInDatabase). The consumer
// binds the Source to its pool and store (consumer.ProgressRecorder); at
// each session's Setup the Source takes the session's partitions over in
// the offsets table (raising each row's epoch, which fences the previous
// owner) and seeks each to the position recorded there; every transaction
// then records its records done in the row, under that epoch.

var (
	_ consumer.ProgressRecorder     = (*Source)(nil)
	_ consumer.PositionDeduplicated = (*delivery)(nil)
)

// errNotBound is Receive's error for a Source with OffsetsInDatabase that
// no consumer bound.
var errNotBound = errors.New("kafka: Config.OffsetsInDatabase is set, but no consumer bound the Source to its database: run it with consumer.New; " +
	"a Source wrapping this one must forward BindProgress and RecordProgress (consumer.ProgressRecorder), for instance by embedding *kafka.Source")

// offsetsBinding is what BindProgress received.
type offsetsBinding struct {
	consumer.ProgressBinding
}

// positions holds what the take-over of a session returned, per
// partition, until its ConsumeClaim takes it.
type positions struct {
	mu   sync.Mutex
	byTP map[topicPartition]dedup.PartitionOffsets
}

type topicPartition struct {
	topic     string
	partition int32
}

func (p *positions) put(all []dedup.PartitionOffsets) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.byTP = make(map[topicPartition]dedup.PartitionOffsets, len(all))
	for _, o := range all {
		p.byTP[topicPartition{o.Topic, o.Partition}] = o
	}
}

func (p *positions) take(topic string, partition int32) (dedup.PartitionOffsets, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	o, ok := p.byTP[topicPartition{topic, partition}]
	delete(p.byTP, topicPartition{topic, partition})
	return o, ok
}

// BindProgress implements consumer.ProgressRecorder: with
// Config.OffsetsInDatabase it checks the offsets table's shape and that
// the pool's role may SELECT, INSERT and UPDATE it (an error names the
// table and what is missing), and keeps the binding; without, it does
// nothing.
func (s *Source) BindProgress(ctx context.Context, b consumer.ProgressBinding) error {
	if !s.cfg.OffsetsInDatabase {
		return nil
	}
	if b.Pool == nil || b.Store == nil || b.Consumer == "" {
		return errors.New("kafka: BindProgress needs the consumer's name, pool and store")
	}
	if err := b.Store.CheckOffsets(ctx, b.Pool); err != nil {
		return fmt.Errorf("kafka: Config.OffsetsInDatabase: %w", err)
	}
	if err := b.Store.CheckOffsetsPrivileges(ctx, b.Pool); err != nil {
		return fmt.Errorf("kafka: Config.OffsetsInDatabase: %w", err)
	}
	s.offsets.Store(&offsetsBinding{b})
	return nil
}

// RecordProgress implements consumer.ProgressRecorder: it records the
// deliveries done in tx, in their partition's row, under the epoch of the
// take-over that gave this Source the partition. It fails with an error
// wrapping dedup.ErrFenced when a newer owner took the partition over; the
// claim is then revoked, so that none of its records is handled further
// here. Given a delivery that is not one of this Source's nor unwraps to
// one (an Unwrap() consumer.Delivery method), it fails, and so does every
// later Receive, which stops the consumer: no retry could record it.
// Without Config.OffsetsInDatabase it does nothing.
func (s *Source) RecordProgress(ctx context.Context, tx pgx.Tx, deliveries []consumer.Delivery) error {
	b := s.offsets.Load()
	if b == nil {
		return nil
	}
	var (
		cl      *claim
		offsets []int64
	)
	flush := func() error {
		if cl == nil {
			return nil
		}
		err := b.Store.RecordOffsets(ctx, tx, b.Consumer, cl.offsetsUpdate(offsets))
		if errors.Is(err, dedup.ErrFenced) {
			cl.fence(err, s.fencedBy(ctx, tx, b, cl))
		}
		return err
	}
	for _, dv := range deliveries {
		d, ok := unwrapDelivery(dv)
		if !ok {
			return s.misuse(fmt.Errorf("kafka: Config.OffsetsInDatabase: RecordProgress given a %T, not a delivery of this Source: "+
				"a Source wrapping this one must give its deliveries an Unwrap() consumer.Delivery method returning the delivery it wraps", dv))
		}
		if d.claim != cl {
			if err := flush(); err != nil {
				return err
			}
			cl, offsets = d.claim, offsets[:0]
		}
		offsets = append(offsets, d.raw.Offset)
	}
	return flush()
}

// misuse makes Receive fail with err from now on (the first err given
// wins), so that the consumer stops: RecordProgress fails the same way on
// every retry. It returns err.
func (s *Source) misuse(err error) error {
	s.misuseOnce.Do(func() {
		s.misuseErr = err
		close(s.misused)
	})
	return err
}

// unwrapDelivery returns the Source's delivery dv is or wraps: a wrapper
// (a Source that decorates the deliveries of this one) says what it wraps
// with an Unwrap() consumer.Delivery method.
func unwrapDelivery(dv consumer.Delivery) (*delivery, bool) {
	for range 16 {
		switch v := dv.(type) {
		case *delivery:
			return v, true
		case interface{ Unwrap() consumer.Delivery }:
			dv = v.Unwrap()
		default:
			return nil, false
		}
	}
	return nil, false
}

// DeduplicatedByPosition implements consumer.PositionDeduplicated: true
// with Config.OffsetsInDatabase.
func (d *delivery) DeduplicatedByPosition() bool { return d.claim.db != nil }

// FirstPositionDone implements consumer.FirstPositionChecker: it reads in
// tx whether the offsets table records done the record whose fallback id
// (topic/partition/offset@topic-id) is fallbackID. An id of another shape
// is not one of this adapter's positions: not done.
func (d *delivery) FirstPositionDone(ctx context.Context, tx pgx.Tx, fallbackID string) (bool, error) {
	b := d.claim.src.offsets.Load()
	key, offset, ok := parseFallbackID(fallbackID)
	if b == nil || !ok {
		return false, nil
	}
	return b.Store.OffsetDone(ctx, tx, b.Consumer, key, offset)
}

// parseFallbackID is the inverse of claim.fallbackID. Topic names hold no
// "/" nor "@" (Kafka allows ASCII letters, digits, '.', '_' and '-').
func parseFallbackID(id string) (dedup.PartitionKey, int64, bool) {
	pos, topicID, _ := strings.Cut(id, "@")
	parts := strings.Split(pos, "/")
	if len(parts) != 3 || parts[0] == "" {
		return dedup.PartitionKey{}, 0, false
	}
	partition, err1 := strconv.ParseInt(parts[1], 10, 32)
	offset, err2 := strconv.ParseInt(parts[2], 10, 64)
	if err1 != nil || err2 != nil || partition < 0 || offset < 0 {
		return dedup.PartitionKey{}, 0, false
	}
	return dedup.PartitionKey{Topic: parts[0], Partition: int32(partition), TopicID: topicID}, offset, true
}

// claimOffsets is what a claim knows of its partition's row.
type claimOffsets struct {
	epoch int64
	// doneAbove are the offsets the row recorded done above its prefix
	// when the claim began: their records are skipped. Read by
	// ConsumeClaim's goroutine only.
	doneAbove map[int64]struct{}
	// doneBelow: every record below it is done (its transaction committed,
	// or it was skipped, or it lies before where the claim began); -1 until
	// known.
	doneBelow atomic.Int64
	skipped   atomic.Int64
	// rewindBelow is the row's position when sarama reset the claim's
	// start (the position out of the partition's range,
	// Consumer.Group.ResetInvalidOffsets), -1 otherwise: a first record
	// below it moves the row's position back there (claim.rewind). One
	// above it (the records after the position deleted by retention) needs
	// nothing: the first transaction's DoneBelow moves the row forward.
	rewindBelow int64
}

// newClaimOffsets is the claim state for the take-over's row o, or nil
// without Config.OffsetsInDatabase.
func newClaimOffsets(o dedup.PartitionOffsets, initial int64) *claimOffsets {
	c := &claimOffsets{epoch: o.Epoch, doneAbove: make(map[int64]struct{}, len(o.Done))}
	for _, off := range o.Done {
		c.doneAbove[off] = struct{}{}
	}
	c.doneBelow.Store(-1)
	c.rewindBelow = -1
	if o.Next >= 0 && initial < 0 {
		c.rewindBelow = o.Next
	}
	if initial >= 0 {
		c.doneBelow.Store(initial)
	}
	return c
}

// offsetsUpdate is the update recording offsets done.
func (cl *claim) offsetsUpdate(offsets []int64) dedup.OffsetsUpdate {
	return dedup.OffsetsUpdate{Topic: cl.sc.Topic(), Partition: cl.sc.Partition(), Epoch: cl.db.epoch,
		DoneBelow: cl.db.doneBelow.Load(), Done: offsets}
}

// skip reports whether raw is recorded done; such a record is acked at
// once, without being handed out. The first record of a claim whose
// position was unknown (no committed offset: it starts at
// Config.InitialOffset) sets where the claim's done prefix begins.
func (cl *claim) skip(raw *sarama.ConsumerMessage) bool {
	if cl.db == nil {
		return false
	}
	if cl.db.doneBelow.CompareAndSwap(-1, raw.Offset) && raw.Offset < cl.db.rewindBelow && !cl.rewind(raw.Offset) {
		return true // fenced, or the session ended: the claim is revoked, nothing is handed out
	}
	if _, done := cl.db.doneAbove[raw.Offset]; !done {
		return false
	}
	delete(cl.db.doneAbove, raw.Offset)
	cl.db.skipped.Add(1)
	cl.src.skipped.Add(1)
	_ = cl.ack(cl.newDelivery(raw))
	cl.received(raw.Offset) // read, as far as the lag is concerned
	return true
}

// rewind moves the row's position to start, the claim's first record,
// before any record of the claim is handed out: sarama started the claim
// at Config.InitialOffset, the recorded position being out of the
// partition's range. Past the partition's end (the log truncated) the
// position is above every record the claim handles, and the row's
// position never moves back in RecordOffsets: without this none of them
// would be recorded, and every restart would start at InitialOffset again
// and handle them again. What the row recorded done above the position is
// of the offsets the truncation took, and is forgotten with it. A failure
// to write is retried with backoff, as a take-over is, until the session
// ends (the claim is then revoked): a claim that went on would handle its
// records without recording them, and its records without ids would be
// handled again after a restart. It reports false when the claim was
// fenced or its session ended (the claim is revoked then).
func (cl *claim) rewind(start int64) bool {
	cl.db.rewindBelow = -1
	clear(cl.db.doneAbove)
	b := cl.src.offsets.Load()
	if b == nil {
		return true
	}
	retry := backoff.Retrier{Policy: backoff.Policy{Initial: 100 * time.Millisecond, Max: 5 * time.Second}}
	for {
		moved, err := cl.moveBack(b, start)
		switch {
		case err == nil && moved:
			return true
		case err == nil:
			cl.fence(fmt.Errorf("%w: %s, epoch %d", dedup.ErrFenced, cl.stream, cl.db.epoch), "")
			return false
		}
		cl.src.leaveReadOnly(b, err)
		wait := retry.Delay()
		level := slog.LevelWarn
		if databaseRefused(err) || databaseDeterministic(err) {
			level = slog.LevelError // waiting alone does not cure it, as for a take-over
		}
		cl.src.cfg.Logger.Log(cl.sess.Context(), level, "once/kafka: cannot move the partition's position in the offsets table back to where the claim starts; "+
			"no record of the partition is handed out until it moves; retrying",
			"group", cl.src.cfg.Group, "stream", cl.stream, "table", b.Store.OffsetsTable(), "offset", start, "error", err, "backoff", wait)
		if !backoff.Sleep(cl.sess.Context(), wait) {
			cl.revoke()
			return false
		}
	}
}

// moveBack is rewind's statement, within the consumer's DatabaseTimeout
// (10 s without one). It reports false, without an error, when the row
// has another epoch: the claim was fenced.
func (cl *claim) moveBack(b *offsetsBinding, start int64) (bool, error) {
	bound := 10 * time.Second
	if b.DatabaseTimeout > 0 {
		bound = b.DatabaseTimeout
	}
	ctx, cancel := context.WithTimeout(cl.sess.Context(), bound)
	defer cancel()
	tag, err := b.Pool.Exec(ctx, `UPDATE `+b.Store.OffsetsTable()+` SET next_offset = $5, done = '{}', updated_at = now()
WHERE consumer = $1 AND topic = $2 AND partition = $3 AND epoch = $4`,
		b.Consumer, cl.sc.Topic(), cl.sc.Partition(), cl.db.epoch, start)
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() > 0, nil
}

// advanced records, for the next transaction, that every record below
// next is done; cl.mu is held.
func (cl *claim) advanced(next int64) {
	if cl.db == nil {
		return
	}
	for {
		seen := cl.db.doneBelow.Load()
		if next <= seen || cl.db.doneBelow.CompareAndSwap(seen, next) {
			return
		}
	}
}

// fence revokes a claim whose partition another owner took over. by is
// the Kafka group of that owner, "" when unknown. A member of this
// group is an ordinary new owner (a rebalance); another group under the
// same consumer name is a misconfiguration that waiting does not cure:
// the groups fence each other at each of their rebalances, and split the
// records between them. A claim fenced by another group is kept, idle,
// until its session ends (ConsumeClaim): returning it would end the
// member's whole session, and its group's rebalance would take the
// partition back at once, so that the groups took it from each other at
// about every commit.
func (cl *claim) fence(err error, by string) {
	if by != "" && by != cl.src.cfg.Group {
		cl.fencedByOther.Store(true)
		cl.src.cfg.Logger.Error("once/kafka: partition taken over in the database by another Kafka group under the same consumer name; "+
			"abandoning its records here and leaving the partition until this group's next rebalance. Two groups sharing a consumer.Config.Name "+
			"share its offsets and split the records between them: give each service a Name of its own, or stop the other group",
			"group", cl.src.cfg.Group, "other_group", by, "stream", cl.stream, "error", err)
	} else {
		cl.src.cfg.Logger.Warn("once/kafka: partition taken over by another owner in the database; abandoning its records here",
			"group", cl.src.cfg.Group, "stream", cl.stream, "error", err)
	}
	cl.revoke()
}

// fencedBy returns the Kafka group that last took cl's partition over in
// the offsets table, read in tx; "" when it cannot be read.
func (s *Source) fencedBy(ctx context.Context, tx pgx.Tx, b *offsetsBinding, cl *claim) string {
	var group string
	err := tx.QueryRow(ctx, `SELECT kafka_group FROM `+b.Store.OffsetsTable()+` WHERE consumer = $1 AND topic = $2 AND partition = $3`,
		b.Consumer, cl.sc.Topic(), cl.sc.Partition()).Scan(&group)
	if err != nil {
		return ""
	}
	return group
}

// recordDeadLettered records in the offsets table, outside any
// transaction, that d is done: a record the consumer dead-lettered was
// in no transaction. It ends with ctx (the consumer's ends at its
// shutdown deadline) or after 10 s. A failure is returned (the consumer
// logs it), saying what follows: the claim marked the offset and goes on
// past it, and the partition's next transaction records every record below
// its own done, the dead letter's too; only a partition that changes owner
// (a restart, a rebalance) before then hands the record out again, and it
// may be dead-lettered again. A write refused as read-only resets the pool
// (leaveReadOnly).
func (d *delivery) recordDeadLettered(ctx context.Context) error {
	b := d.claim.src.offsets.Load()
	if b == nil || d.claim.db == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := b.Store.RecordOffsets(ctx, b.Pool, b.Consumer, d.claim.offsetsUpdate([]int64{d.raw.Offset})); err != nil {
		d.claim.src.leaveReadOnly(b, err)
		return fmt.Errorf("kafka: recording dead-lettered %s offset %d in the database (the offset is marked: the record is handed out again, "+
			"and may be dead-lettered again, only if its partition changes owner before another of its records is recorded done): %w",
			d.claim.stream, d.raw.Offset, err)
	}
	return nil
}

// recordStart records in the offsets table, outside any transaction, that
// cl's partition starts at start, where the table had no position (or one
// below the partition's first record, checkRecordedStart): the
// records below it are not this consumer's to handle (the group's
// committed offset, or StartNewest's start). Without it a partition that
// gets no record before Kafka forgets the group's offsets has no position
// in the table, and starts at Config.InitialOffset again: under
// StartNewest, past the records produced meanwhile. A failure is logged:
// the partition's first transaction records a position as well.
func (s *Source) recordStart(cl *claim, start int64) {
	b := s.offsets.Load()
	if b == nil {
		return
	}
	bound := 10 * time.Second
	if b.DatabaseTimeout > 0 {
		bound = b.DatabaseTimeout
	}
	ctx, cancel := context.WithTimeout(cl.sess.Context(), bound)
	defer cancel()
	err := b.Store.RecordOffsets(ctx, b.Pool, b.Consumer, dedup.OffsetsUpdate{Topic: cl.sc.Topic(), Partition: cl.sc.Partition(),
		Epoch: cl.db.epoch, DoneBelow: start})
	if errors.Is(err, dedup.ErrFenced) {
		cl.fence(err, "")
		return
	}
	if err != nil {
		s.leaveReadOnly(b, err)
		s.cfg.Logger.Warn("once/kafka: cannot record the partition's start in the offsets table",
			"group", s.cfg.Group, "stream", cl.stream, "offset", start, "error", err)
	}
}

// recordPassed records in the offsets table, outside any transaction,
// that every record of the partition below start is passed (deleted by
// retention before it was handled), under the take-over's epoch, within
// the consumer's DatabaseTimeout (10 s without one). The row's position
// only moves forward.
func (b *offsetsBinding) recordPassed(ctx context.Context, topic string, partition int32, epoch, start int64) error {
	bound := 10 * time.Second
	if b.DatabaseTimeout > 0 {
		bound = b.DatabaseTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	return b.Store.RecordOffsets(ctx, b.Pool, b.Consumer, dedup.OffsetsUpdate{Topic: topic, Partition: partition, Epoch: epoch, DoneBelow: start})
}

// takeOver takes parts over for owner in the offsets table, once, within
// the consumer's DatabaseTimeout: a pooled connection whose server
// vanished without a word (a failover's old primary, a middlebox) is then
// left behind, and the take-over retried on another, instead of holding
// the session's partitions until the operating system gives up on it.
func (b *offsetsBinding) takeOver(ctx context.Context, owner dedup.Owner, parts []dedup.PartitionKey) ([]dedup.PartitionOffsets, error) {
	if b.DatabaseTimeout <= 0 {
		return b.Store.TakeOverPartitions(ctx, b.Pool, b.Consumer, owner, parts)
	}
	actx, cancel := context.WithTimeout(ctx, b.DatabaseTimeout)
	defer cancel()
	got, err := b.Store.TakeOverPartitions(actx, b.Pool, b.Consumer, owner, parts)
	if err != nil && ctx.Err() == nil && errors.Is(actx.Err(), context.DeadlineExceeded) {
		// What stranded the connection (a failover, a middlebox) has
		// most likely stranded the pool's others too, as the consumer
		// finds: they are closed, and the retry opens a new one.
		b.Pool.Reset()
		err = fmt.Errorf("no answer within the consumer's DatabaseTimeout (%s), the pool's connections closed: %w", b.DatabaseTimeout, err)
	}
	return got, err
}

// takeOver takes the session's partitions over in the offsets table and
// seeks each partition the table knows to its recorded position. It
// retries failures with backoff until the session ends; a refusal of the
// database (authentication, a privilege) or another error waiting does
// not cure (an undefined table or column) is logged at level Error, and a
// write refused as read-only (a failover) resets the pool first
// (leaveReadOnly).
func (s *Source) takeOver(sess sarama.ConsumerGroupSession) error {
	b := s.offsets.Load()
	if b == nil {
		return errNotBound
	}
	ctx := sess.Context()
	var parts []dedup.PartitionKey
	for topic, ps := range sess.Claims() {
		id, err := s.topicIDs.lookup(ctx, topic)
		if err != nil {
			return fmt.Errorf("kafka: topic id of %s: %w", topic, err)
		}
		for _, p := range ps {
			parts = append(parts, dedup.PartitionKey{Topic: topic, Partition: p, TopicID: id})
		}
	}
	owner := dedup.Owner{Group: s.cfg.Group, Generation: sess.GenerationID()}
	retry := backoff.Retrier{Policy: backoff.Policy{Initial: 100 * time.Millisecond, Max: 5 * time.Second}}
	for {
		got, err := b.takeOver(ctx, owner, parts)
		if err == nil {
			if s.cfg.InitialOffset == StartNewest {
				s.startAtRecordsLeft(ctx, b, got)
			}
			s.positions.put(got)
			for _, o := range got {
				if o.Next >= 0 {
					// ResetOffset moves back only, MarkOffset forward
					// only: together they seek to Next either way.
					sess.ResetOffset(o.Topic, o.Partition, o.Next, "")
					sess.MarkOffset(o.Topic, o.Partition, o.Next, "")
				}
			}
			return nil
		}
		s.leaveReadOnly(b, err)
		wait := retry.Delay()
		switch {
		case databaseRefused(err):
			s.cfg.Logger.Error("once/kafka: the database refuses taking partitions over in the offsets table (authentication or privileges); no record is consumed until that is fixed; retrying",
				"group", s.cfg.Group, "table", b.Store.OffsetsTable(), "error", err, "backoff", wait)
		case databaseDeterministic(err):
			s.cfg.Logger.Error("once/kafka: taking partitions over in the offsets table fails in a way waiting does not cure (the table or a column renamed or dropped, the schema moved back: see once migrate status); no record is consumed until that is fixed; retrying",
				"group", s.cfg.Group, "table", b.Store.OffsetsTable(), "error", err, "backoff", wait)
		default:
			s.cfg.Logger.Warn("once/kafka: taking partitions over in the database failed; retrying",
				"group", s.cfg.Group, "error", err, "backoff", wait)
		}
		if !backoff.Sleep(ctx, wait) {
			return fmt.Errorf("kafka: taking partitions over: %w", err)
		}
	}
}

// positionedInDatabase returns, with Config.OffsetsInDatabase, the
// partitions of the topics of sess (claimed here or not) that the offsets
// table gives this consumer a position in, under the topic's id; nil
// without the option. markStarts marks no start for them (the take-over
// seeks them to their position), and takes their topics for topics the
// group reads: Kafka may have forgotten the group's offsets
// (offsets.retention.minutes, the group deleted or renamed), which the
// table is there to survive, and a partition added to the topic meanwhile
// is then read from its first record, not from its end past the records
// produced to it. It retries failures with backoff until the session
// ends, as takeOver does: no record is consumed without the table anyway,
// and the starts markStarts commits are those of when the database
// answers, as the session begins consuming then.
func (s *Source) positionedInDatabase(sess sarama.ConsumerGroupSession) (map[topicPartition]bool, error) {
	if !s.cfg.OffsetsInDatabase || len(sess.Claims()) == 0 {
		return nil, nil
	}
	b := s.offsets.Load()
	if b == nil {
		return nil, errNotBound
	}
	ctx := sess.Context()
	var topics, ids []string
	for topic := range sess.Claims() {
		id, err := s.topicIDs.lookup(ctx, topic)
		if err != nil {
			return nil, fmt.Errorf("kafka: topic id of %s: %w", topic, err)
		}
		topics, ids = append(topics, topic), append(ids, id)
	}
	retry := backoff.Retrier{Policy: backoff.Policy{Initial: 100 * time.Millisecond, Max: 5 * time.Second}}
	for {
		got, err := b.positioned(ctx, topics, ids)
		if err == nil {
			return got, nil
		}
		s.leaveReadOnly(b, err)
		wait := retry.Delay()
		s.cfg.Logger.Warn("once/kafka: reading the partitions' positions in the offsets table failed; retrying",
			"group", s.cfg.Group, "table", b.Store.OffsetsTable(), "error", err, "backoff", wait)
		if !backoff.Sleep(ctx, wait) {
			return nil, fmt.Errorf("kafka: reading the offsets table: %w", err)
		}
	}
}

// positioned is positionedInDatabase's question, within the consumer's
// DatabaseTimeout: a connection stranded by a failover is left behind, and
// the pool's connections closed, as takeOver does.
func (b *offsetsBinding) positioned(ctx context.Context, topics, ids []string) (map[topicPartition]bool, error) {
	qctx := ctx
	if b.DatabaseTimeout > 0 {
		var cancel context.CancelFunc
		qctx, cancel = context.WithTimeout(ctx, b.DatabaseTimeout)
		defer cancel()
	}
	got := make(map[topicPartition]bool)
	rows, err := b.Pool.Query(qctx, `SELECT o.topic, o.partition FROM `+b.Store.OffsetsTable()+` AS o
JOIN unnest($2::text[], $3::text[]) AS u(t, id) ON o.topic = u.t AND o.topic_id = u.id
WHERE o.consumer = $1 AND o.next_offset >= 0`, b.Consumer, topics, ids)
	if err == nil {
		var tp topicPartition
		_, err = pgx.ForEachRow(rows, []any{&tp.topic, &tp.partition}, func() error { got[tp] = true; return nil })
	}
	if err != nil && ctx.Err() == nil && errors.Is(qctx.Err(), context.DeadlineExceeded) {
		b.Pool.Reset()
		err = fmt.Errorf("no answer within the consumer's DatabaseTimeout (%s), the pool's connections closed: %w", b.DatabaseTimeout, err)
	}
	return got, err
}

// startAtRecordsLeft moves, under StartNewest, each position of got that
// lies below its partition's first record (the records deleted by
// retention before any member read them) to that first record, logging
// the deleted records at level Error and counting them as checkRecordedStart
// does. sarama would reset such a position to Config.InitialOffset, under
// StartNewest the partition's end, past the records the partition still
// holds; StartNewest says where a consumer new to a partition starts, and
// this one has a position. A partition whose first record cannot be asked
// keeps its position (sarama's reset, then checkRecordedStart's log).
//
// A partition the table has no position for starts at the group's
// committed offset (the option just turned on): one below the first
// record is moved there the same way (committedBelowFirst), as a claim
// without OffsetsInDatabase does (rewindNewestStart).
//
// The position moved is recorded in the table before the loss is logged:
// a partition that then gets no record kept the old one, and every later
// take-over (each restart, each rebalance) logged the same records lost
// again and counted them again. A failure to record it is logged at Warn.
func (s *Source) startAtRecordsLeft(ctx context.Context, b *offsetsBinding, got []dedup.PartitionOffsets) {
	s.committedBelowFirst(got)
	for i := range got {
		o := &got[i]
		if o.Next < 0 {
			continue
		}
		first, err := s.dlqClient.GetOffset(o.Topic, o.Partition, sarama.OffsetOldest)
		if err != nil || o.Next >= first {
			continue
		}
		if err := b.recordPassed(ctx, o.Topic, o.Partition, o.Epoch, first); err != nil {
			s.leaveReadOnly(b, err)
			s.cfg.Logger.Warn("once/kafka: cannot record in the offsets table the partition's first record left as its position; the next take-over finds the loss again",
				"group", s.cfg.Group, "topic", o.Topic, "partition", o.Partition, "offset", first, "error", err)
		}
		s.lag.skippedOutOfRange(o.Topic, o.Partition, first-o.Next)
		s.cfg.Logger.Error("once/kafka: the position the database records for the partition is out of the partition's range "+
			"(its records deleted by retention before they were handled, or the log truncated); the claim starts at the partition's first record left, "+
			"and the records between the two are not handled",
			"group", s.cfg.Group, "topic", o.Topic, "partition", o.Partition, "recorded", o.Next,
			"start", first, "initial_offset", startName(sarama.OffsetNewest), "skipped", first-o.Next)
		o.Next = first
	}
}

// committedBelowFirst gives each partition of got that the table has no
// position for, and whose group's committed offset lies below its first
// record (the records deleted by retention before the group read them),
// that first record as its position, logging the deleted records at level
// Error and counting them as checkStart does. sarama would reset such a
// committed offset to Config.InitialOffset, under StartNewest the
// partition's end, and the records left would be skipped with the deleted
// ones. A question the cluster does not answer leaves the positions
// unknown (sarama's reset, then checkStart's log).
func (s *Source) committedBelowFirst(got []dedup.PartitionOffsets) {
	unknown := make(map[string][]int32)
	for _, o := range got {
		if o.Next < 0 {
			unknown[o.Topic] = append(unknown[o.Topic], o.Partition)
		}
	}
	if len(unknown) == 0 {
		return
	}
	committed, err := s.committedOffsets(unknown)
	if err != nil {
		return
	}
	for i := range got {
		o := &got[i]
		c, ok := committed[topicPartition{o.Topic, o.Partition}]
		if o.Next >= 0 || !ok || c < 0 {
			continue
		}
		first, err := s.dlqClient.GetOffset(o.Topic, o.Partition, sarama.OffsetOldest)
		if err != nil || c >= first {
			continue
		}
		s.lag.skippedOutOfRange(o.Topic, o.Partition, first-c)
		s.cfg.Logger.Error("once/kafka: the group's committed offset is out of the partition's range "+
			"(its records deleted by retention before they were handled, or the log truncated); the claim starts at the partition's first record left, "+
			"and the records between the two are not handled",
			"group", s.cfg.Group, "topic", o.Topic, "partition", o.Partition, "committed", c,
			"start", first, "initial_offset", startName(sarama.OffsetNewest), "skipped", first-c)
		o.Next = first
	}
}

// leaveReadOnly resets the consumer's pool when err says a write was
// refused as read-only (SQLSTATE 25006), as the consumer does for its own
// writes: after a failover the pool's connections may reach the old
// primary, now a standby, and every retry on them would be refused the
// same way until the pool retired them (pgxpool.Config.MaxConnLifetime).
// The pool closes its idle connections at once and the others when they
// are released; the retry opens a new one, to the writable server.
func (s *Source) leaveReadOnly(b *offsetsBinding, err error) {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "25006" {
		return
	}
	s.cfg.Logger.Warn("once/kafka: the database refused a write of the offsets table as read-only (a failover?); closing the pool's connections",
		"group", s.cfg.Group, "table", b.Store.OffsetsTable(), "error", err)
	b.Pool.Reset()
}

// databaseRefused reports whether err is PostgreSQL refusing the role
// what it needs: the authentication (SQLSTATE class 28) or a privilege
// (42501).
func databaseRefused(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (strings.HasPrefix(pe.Code, "28") || pe.Code == "42501")
}

// databaseDeterministic reports whether err is an error of PostgreSQL's
// that retrying cannot cure (consumer.Classify: not infrastructure), such
// as an undefined table or column.
func databaseDeterministic(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && consumer.Classify(err) != consumer.ClassInfrastructure
}

// skippedRecords returns how many records were skipped as recorded done.
func (s *Source) skippedRecords() int64 { return s.skipped.Load() }

// cooperativeStrategy returns the name of a balance strategy of sc that
// may take part in the cooperative rebalance protocol, "" when none may:
// cooperative-sticky, or any strategy that declares the protocol
// (sarama.RebalanceProtocolBalanceStrategy), whatever its name, as sarama
// runs the cooperative protocol when every strategy declares it. A list
// of strategies that sarama would run eagerly (one of them eager only)
// is refused too: the check does not rely on sarama's choice among them.
func cooperativeStrategy(sc *sarama.Config) string {
	strategies := append([]sarama.BalanceStrategy(nil), sc.Consumer.Group.Rebalance.GroupStrategies...)
	if sc.Consumer.Group.Rebalance.Strategy != nil {
		strategies = append(strategies, sc.Consumer.Group.Rebalance.Strategy)
	}
	for _, st := range strategies {
		if st == nil {
			continue
		}
		if st.Name() == sarama.CooperativeStickyBalanceStrategyName {
			return st.Name()
		}
		if p, ok := st.(sarama.RebalanceProtocolBalanceStrategy); ok && slices.Contains(p.SupportedProtocols(), sarama.RebalanceProtocolCooperative) {
			return st.Name()
		}
	}
	return ""
}
