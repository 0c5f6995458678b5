package kafka

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"

	"github.com/onceco/once/consumer"
)

// unknownOffset marks a claim whose position is not known yet.
const unknownOffset = -2

// claim is one partition's assignment in one consumer-group session. It
// keeps the deliveries it handed out and not yet settled, in offset order,
// and marks offsets only over a settled prefix of them, so that a mark never
// skips an unsettled record even if acks came out of order.
type claim struct {
	src    *Source
	sess   sarama.ConsumerGroupSession
	sc     sarama.ConsumerGroupClaim
	stream string
	// topicID is the topic's id ("" when the cluster has none): it is part
	// of the fallback id, because a topic created again under the same
	// name numbers its offsets from 0 again.
	topicID string
	// db is the partition's row in the offsets table, with
	// Config.OffsetsInDatabase; nil without.
	db     *claimOffsets
	ctx    context.Context // done when the claim is revoked
	cancel context.CancelFunc
	last   atomic.Int64 // offset of the last record handed out or skipped, or unknownOffset
	paused atomic.Bool  // its fetching paused by feed: sarama's high-water mark of it is stale
	// fencedByOther: another group under the same consumer name took the
	// partition over in the database (claim.fence).
	fencedByOther atomic.Bool
	// endAsked: a question of the partition's end to the cluster is
	// running (lag.go); end is its latest answer, nil until one.
	endAsked atomic.Bool
	end      atomic.Pointer[readableEnd]
	// topicAsked: a question of whether the claim's topic still exists
	// is running (topicgone.go).
	topicAsked atomic.Bool
	// topicMissing counts the answers in a row that the topic is unknown;
	// topicGone is what the claim found (topicThere, topicDeleted,
	// topicRecreated).
	topicMissing atomic.Int32
	topicGone    atomic.Int32

	mu      sync.Mutex
	revoked bool
	pending []*delivery   // handed out, not settled, in offset order
	settled chan struct{} // signalled when pending becomes empty
	room    chan struct{} // signalled when pending shrinks
	// markBack: the claim started at Config.InitialOffset (the group had
	// no committed offset, or sarama reset one out of the partition's
	// range) and has marked nothing yet; its first mark sets the group's
	// offset whichever side of the committed one it lies (commitStart,
	// ack), as one past the partition's end is above every record.
	markBack bool
}

func newClaim(s *Source, sess sarama.ConsumerGroupSession, sc sarama.ConsumerGroupClaim, topicID string) *claim {
	ctx, cancel := context.WithCancel(context.Background())
	cl := &claim{
		topicID: topicID,
		src:     s,
		sess:    sess,
		sc:      sc,
		stream:  sc.Topic() + "/" + strconv.FormatInt(int64(sc.Partition()), 10),
		ctx:     ctx,
		cancel:  cancel,
		settled: make(chan struct{}, 1),
		room:    make(chan struct{}, 1),
	}
	// InitialOffset is the committed offset, or OffsetOldest/OffsetNewest
	// (negative) when the group has none: the position is then unknown
	// until the first record arrives.
	if off := sc.InitialOffset(); off >= 0 {
		cl.last.Store(off - 1)
	} else {
		cl.last.Store(unknownOffset)
		cl.markBack = true
	}
	return cl
}

// commitStart commits start, where sarama started the claim, as the
// group's offset of the partition, whose committed offset checkStart found
// out of the partition's range, unless the claim marked an ack already
// (committed within Config.CommitInterval) or was revoked. A session that
// ended first commits nothing: the next one finds the same offset.
func (cl *claim) commitStart(start int64) {
	cl.mu.Lock()
	first := cl.markBack && !cl.revoked
	if first {
		cl.markAt(start)
	}
	cl.mu.Unlock()
	if first {
		cl.sess.Commit()
	}
}

// markAt marks next as the partition's offset; cl.mu is held. sarama's
// MarkOffset moves the offset forward only: the claim's first mark resets
// it first (markBack), so that a committed offset past the partition's end
// does not swallow every ack of the claim.
func (cl *claim) markAt(next int64) {
	topic, partition := cl.sc.Topic(), cl.sc.Partition()
	if cl.markBack {
		cl.markBack = false
		cl.sess.ResetOffset(topic, partition, next, "")
	}
	cl.sess.MarkOffset(topic, partition, next, "")
}

// newDelivery wraps raw and appends it to the pending list.
func (cl *claim) newDelivery(raw *sarama.ConsumerMessage) *delivery {
	headers := make(map[string]string, len(raw.Headers))
	for _, h := range raw.Headers {
		if h != nil {
			headers[string(h.Key)] = string(h.Value)
		}
	}
	d := &delivery{claim: cl, raw: raw}
	d.msg = consumer.Message{
		FallbackID: cl.fallbackID(raw.Offset),
		Key:        raw.Key,
		Value:      raw.Value,
		Headers:    headers,
		Topic:      raw.Topic,
		Partition:  raw.Partition,
		Offset:     raw.Offset,
		Timestamp:  raw.Timestamp,
		Stream:     cl.laneOf(raw.Key),
	}
	cl.mu.Lock()
	cl.pending = append(cl.pending, d)
	n := int32(len(cl.pending))
	cl.mu.Unlock()
	storeMax(&cl.src.pendingMax, n)
	return d
}

// storeMax raises v to n if n is larger.
func storeMax(v *atomic.Int32, n int32) {
	for {
		seen := v.Load()
		if n <= seen || v.CompareAndSwap(seen, n) {
			return
		}
	}
}

// stallAfter is how long a claim whose read-ahead is full waits for
// Receive to take a record before it pauses the partition's fetching and
// reads on what sarama had fetched, to see the claim end.
const stallAfter = 50 * time.Millisecond

// feed hands the claim's records to Receive, one at a time and in offset
// order, until the claim ends: its session ended (ended), the Source is
// closing, the claim was fenced, or sarama closed its Messages() (the
// partition revoked by a cooperative rebalance, whose session goes on).
//
// Whatever it waits for (room below Config.MaxPendingPerPartition, or
// Receive to take a record) it keeps reading Messages(), so that it sees
// the claim end within RevokeTimeout even while the consumer takes no
// record: the records read meanwhile wait in a backlog, handed out first.
// Fetching is paused while the claim is at the bound (a stuck record, with
// KeyLanes, holds the partition's marks back; records fetched meanwhile
// would pile up behind it), and while the backlog holds readAhead records
// that Receive left for stallAfter; what is read then is only what sarama
// had fetched already. Below that the backlog is read ahead without a
// pause, which a consumer that keeps receiving never notices.
func (cl *claim) feed(ended <-chan struct{}) {
	s := cl.src
	bound := s.cfg.MaxPendingPerPartition
	readAhead := max(1, s.readAhead)
	part := map[string][]int32{cl.sc.Topic(): {cl.sc.Partition()}}
	var (
		msgs    = cl.sc.Messages()
		backlog []*sarama.ConsumerMessage // read, not handed out yet
		next    *delivery                 // pending, waiting for Receive
		paused  bool
		atBound bool // counted in waitingForRoom
		stalled bool // the backlog full and untouched for stallAfter
		stall   *time.Timer
		stallC  <-chan time.Time // while the backlog is full and not stalled yet
	)
	// One channel for the three ends, so that the loop's select stays
	// small: it runs twice per record.
	done := make(chan struct{})
	stopWatch := make(chan struct{})
	defer close(stopWatch)
	go func() {
		select {
		case <-ended:
		case <-s.closing:
		case <-cl.ctx.Done(): // fenced
		case <-stopWatch:
			return
		}
		close(done)
	}()
	defer func() {
		if next != nil {
			cl.drop(next)
		}
		if atBound {
			s.waitingForRoom.Add(-1)
		}
		if paused {
			s.group.Resume(part)
			cl.paused.Store(false)
		}
		if stall != nil {
			stall.Stop()
		}
	}()
	for {
		pending := cl.pendingCount()
		if next == nil && len(backlog) > 0 && pending < bound {
			raw := backlog[0]
			backlog[0] = nil
			backlog = backlog[1:]
			if cl.skip(raw) {
				continue
			}
			next = cl.newDelivery(raw)
		}
		if bounded := next == nil && pending >= bound; bounded != atBound {
			atBound = bounded
			if atBound {
				s.waitingForRoom.Add(1)
				s.cfg.Logger.Debug("once/kafka: partition paused: pending records at the bound",
					"group", s.cfg.Group, "stream", cl.stream, "max_pending", bound)
			} else {
				s.waitingForRoom.Add(-1)
			}
		}
		full := len(backlog) >= readAhead
		switch {
		case !full:
			stalled, stallC = false, nil
		case !stalled && stallC == nil:
			if stall == nil {
				stall = time.NewTimer(stallAfter)
			} else {
				stall.Reset(stallAfter)
			}
			stallC = stall.C
		}
		if pause := atBound || stalled; pause != paused {
			paused = pause
			if paused {
				s.group.Pause(part)
			} else {
				s.group.Resume(part)
			}
			cl.paused.Store(paused)
		}
		in := msgs
		if full && !paused {
			in = nil // read no further ahead while fetching goes on
		}
		var out chan<- *delivery
		if next != nil {
			out = s.deliveries
		}
		var room <-chan struct{}
		if atBound {
			room = cl.room
		}
		select {
		case raw, ok := <-in:
			if !ok {
				return
			}
			backlog = append(backlog, raw)
		case out <- next:
			cl.received(next.raw.Offset)
			next = nil
		case <-stallC:
			stalled, stallC = true, nil
		case <-room:
		case <-done:
			return
		}
	}
}

func (cl *claim) pendingCount() int {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	return len(cl.pending)
}

// notifyRoom signals feed that pending shrank; cl.mu is held.
func (cl *claim) notifyRoom() {
	select {
	case cl.room <- struct{}{}:
	default:
	}
}

// fallbackID is the id of a record without an id header:
// "topic/partition/offset", followed by "@" and the topic's id when the
// cluster has topic ids (Kafka 2.8+).
func (cl *claim) fallbackID(offset int64) string {
	id := cl.stream + "/" + strconv.FormatInt(offset, 10)
	if cl.topicID != "" {
		id += "@" + cl.topicID
	}
	return id
}

// laneOf is the stream of a record with key: the partition's, or with
// Config.KeyLanes one of its key lanes.
func (cl *claim) laneOf(key []byte) string {
	lanes := cl.src.cfg.KeyLanes
	if lanes <= 1 {
		return cl.stream
	}
	h := fnv.New32a()
	h.Write(key)
	return cl.stream + "#" + strconv.FormatUint(uint64(h.Sum32()%uint32(lanes)), 10)
}

// received records that d was handed to Receive.
func (cl *claim) received(offset int64) {
	cl.last.Store(offset)
}

// drop removes d, the last delivery, which was never handed out.
func (cl *claim) drop(d *delivery) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if n := len(cl.pending); n > 0 && cl.pending[n-1] == d {
		cl.pending[n-1] = nil
		cl.pending = cl.pending[:n-1]
	}
	cl.notifyRoom()
	cl.notifyIfSettled()
}

// ack settles d and marks the offset after the longest settled prefix of
// the pending deliveries.
func (cl *claim) ack(d *delivery) error {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if cl.revoked {
		return fmt.Errorf("%w: %s offset %d not marked", ErrRevoked, cl.stream, d.raw.Offset)
	}
	if d.acked {
		return nil
	}
	d.acked = true
	var mark *delivery
	for len(cl.pending) > 0 && cl.pending[0].acked {
		mark = cl.pending[0]
		cl.pending[0] = nil
		cl.pending = cl.pending[1:]
	}
	if mark != nil {
		cl.markAt(mark.raw.Offset + 1)
		cl.advanced(mark.raw.Offset + 1)
		cl.notifyRoom()
	}
	cl.notifyIfSettled()
	return nil
}

// notifyIfSettled signals awaitSettled; cl.mu is held.
func (cl *claim) notifyIfSettled() {
	if len(cl.pending) == 0 {
		select {
		case cl.settled <- struct{}{}:
		default:
		}
	}
}

// awaitSettled waits until no handed-out delivery is unsettled, bound
// expires, or closing is closed.
func (cl *claim) awaitSettled(bound time.Duration, closing <-chan struct{}) {
	t := time.NewTimer(bound)
	defer t.Stop()
	for {
		cl.mu.Lock()
		n := len(cl.pending)
		cl.mu.Unlock()
		if n == 0 {
			return
		}
		select {
		case <-cl.settled:
		case <-t.C:
			cl.src.cfg.Logger.Warn("once/kafka: revoked partition not settled in time; abandoning its deliveries",
				"group", cl.src.cfg.Group, "stream", cl.stream, "unsettled", n, "revoke_timeout", bound)
			return
		case <-closing:
			return
		}
	}
}

// revoke ends the claim: no Ack marks anything after it, and the contexts
// of its deliveries are done.
func (cl *claim) revoke() {
	cl.mu.Lock()
	cl.revoked = true
	cl.pending = nil
	cl.mu.Unlock()
	cl.cancel()
}

func (cl *claim) isRevoked() bool {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	return cl.revoked
}

// delivery is one record handed to the consumer core.
type delivery struct {
	claim *claim
	raw   *sarama.ConsumerMessage
	msg   consumer.Message
	acked bool // guarded by claim.mu
	// deadLettered: its dead-letter copy was written; with
	// Config.OffsetsInDatabase, Ack records it done in the database.
	deadLettered atomic.Bool
}

// Message returns the record as a consumer.Message.
func (d *delivery) Message() *consumer.Message { return &d.msg }

// Context is done once the record's partition is revoked and the revoke
// bound expired, or the session ended.
func (d *delivery) Context() context.Context { return d.claim.ctx }

// Ack marks the record's offset in the session that delivered it; the mark
// is committed within Config.CommitInterval, on revoke or on Close. It
// returns ErrRevoked, marking nothing, once the claim was revoked.
//
// With Config.OffsetsInDatabase the record's transaction recorded it done
// in the database; a dead-lettered record, which had none, is recorded by
// Ack after its offset is marked, and a failure to is returned: the record
// is then handed out again only if its partition changes owner before
// another of its records is recorded done (recordDeadLettered).
func (d *delivery) Ack(ctx context.Context) error {
	if err := d.claim.ack(d); err != nil {
		return err
	}
	if d.deadLettered.Load() {
		return d.recordDeadLettered(ctx)
	}
	return nil
}

// DeadLetter produces a copy of the record to its dead-letter topic and
// returns once the brokers confirmed it, or ctx is done (the copy may then
// still be written). It returns ErrRevoked without writing once the claim
// was revoked: the record's next owner dead-letters it instead. A copy the
// cluster refuses until it is fixed there (the dead-letter topic missing
// or made compacted, the client not authorized to write it) is logged at
// level Error to
// Config.Logger, each time, besides being returned.
func (d *delivery) DeadLetter(ctx context.Context, dl *consumer.DeadLetter) error {
	if d.claim.isRevoked() {
		return fmt.Errorf("%w: %s offset %d not dead-lettered", ErrRevoked, d.claim.stream, d.raw.Offset)
	}
	if err := d.claim.src.deadLetter(ctx, d.raw, &d.msg, dl); err != nil {
		return err
	}
	if d.claim.isRevoked() {
		// Revoked while the copy was being written: the copy stands, but
		// the record goes back unmarked to the partition's next owner,
		// which dead-letters it again.
		return fmt.Errorf("%w: %s offset %d dead-lettered after the revoke; not settled here", ErrRevoked, d.claim.stream, d.raw.Offset)
	}
	d.deadLettered.Store(true)
	return nil
}

func (s *Source) deadLetter(ctx context.Context, raw *sarama.ConsumerMessage, m *consumer.Message, dl *consumer.DeadLetter) error {
	if dl == nil {
		return errors.New("kafka: DeadLetter called with a nil *consumer.DeadLetter")
	}
	out := &sarama.ProducerMessage{
		Topic:   s.cfg.DeadLetter.Topic(raw.Topic),
		Headers: deadLetterHeaders(raw.Headers, dl.Headers(m)),
	}
	// A null key or value stays null, an empty one stays empty.
	if raw.Key != nil {
		out.Key = sarama.ByteEncoder(raw.Key)
	}
	if raw.Value != nil {
		out.Value = sarama.ByteEncoder(raw.Value)
	}

	// Look the topic up first: a send to a missing topic would trip the
	// producer's per-topic circuit breaker, which then fails every send to
	// the topic for 10 s, even once it exists.
	if _, err := s.dlqClient.Partitions(out.Topic); err != nil {
		s.logRefusedCopy(raw, out.Topic, err)
		return fmt.Errorf("kafka: dead-letter copy of %s/%d/%d: topic %s: %w",
			raw.Topic, raw.Partition, raw.Offset, out.Topic, err)
	}
	err := s.send(ctx, out, false)
	if refusedForSize(err) {
		// The broker refuses a whole batch for its size: a topic whose
		// max.message.bytes (or segment.bytes) is below the producer's
		// MaxMessageBytes refuses copies batched together (concurrent
		// dead letters) that it takes one by one. Sent again alone, in a
		// batch of its own, before anything is dropped from it.
		err = s.send(ctx, out, true)
	}
	if tooLarge(err) && out.Value != nil {
		// The record is too large for the dead-letter producer or topic:
		// a copy that can never be written would hold the partition
		// forever. Write the diagnostics without the value instead; the
		// original stays in its topic, at the offset in the headers.
		s.cfg.Logger.Warn("once/kafka: dead-letter copy too large; writing it without its value",
			"topic", raw.Topic, "partition", raw.Partition, "offset", raw.Offset, "bytes", len(raw.Value))
		out.Value = nil
		out.Headers = append(out.Headers, valueDropped(raw))
		err = s.send(ctx, out, true)
	}
	if tooLarge(err) {
		// Still too large without its value: the key or the headers are
		// (an oversized event id or type is written twice, as the
		// original header and as a diagnostic). Write the diagnostics
		// alone, each cut, without the key.
		s.cfg.Logger.Warn("once/kafka: dead-letter copy too large without its value; writing its diagnostics alone",
			"topic", raw.Topic, "partition", raw.Partition, "offset", raw.Offset, "key_and_header_bytes", keyAndHeaderBytes(raw))
		out.Key, out.Value = nil, nil
		out.Headers = append(deadLetterHeaders(nil, cutDiagnostics(dl.Headers(m))), valueDropped(raw),
			sarama.RecordHeader{Key: []byte(HeaderOriginalDropped), Value: []byte(strconv.Itoa(keyAndHeaderBytes(raw)))})
		err = s.send(ctx, out, true)
	}
	if err != nil {
		s.logRefusedCopy(raw, out.Topic, err)
		return fmt.Errorf("kafka: dead-letter copy of %s/%d/%d to %s: %w",
			raw.Topic, raw.Partition, raw.Offset, out.Topic, err)
	}
	return nil
}

// logRefusedCopy logs at level Error a dead-letter copy of raw that the
// cluster refuses until it is fixed there: the client no longer
// authorized to write topic (its ACLs changed since Open checked them),
// topic deleted since, or made compacted since (INVALID_RECORD for a
// record without a key). The core retries the copy at level Warn, as it
// does any failure, including those that pass by themselves (a leader
// election, too few in-sync replicas); these do not, and the partition
// waits at raw until someone acts on the cluster.
func (s *Source) logRefusedCopy(raw *sarama.ConsumerMessage, topic string, err error) {
	var what string
	switch {
	case errors.Is(err, sarama.ErrTopicAuthorizationFailed), errors.Is(err, sarama.ErrClusterAuthorizationFailed):
		what = "the cluster does not authorize this client to write the dead-letter topic (an ACL of its principal removed?)"
	case errors.Is(err, sarama.ErrUnknownTopicOrPartition):
		// Also met for a moment while partitions move: asked again.
		_ = s.dlqClient.RefreshMetadata(topic)
		if exists, err := topicExists(s.dlqClient, topic); err != nil || exists {
			return
		}
		what = "the dead-letter topic does not exist (deleted since Open?)"
	case errors.Is(err, sarama.ErrInvalidRecord):
		what = "the broker rejects the record (a dead-letter topic made compacted since Open refuses a record without a key)"
	default:
		return
	}
	s.cfg.Logger.Error("once/kafka: dead-letter copy refused: "+what+"; the record stays unacked and its partition waits at it until that is fixed on the cluster",
		"group", s.cfg.Group, "dead_letter_topic", topic, "topic", raw.Topic, "partition", raw.Partition, "offset", raw.Offset, "error", err)
}

// HeaderValueDropped is set, to the original value's size in bytes, on a
// dead-letter copy written without its value because the value was larger
// than the dead-letter producer or topic accepts. The original record is
// still in its topic, at the partition and offset of the copy's headers.
const HeaderValueDropped = "once-value-dropped"

// HeaderOriginalDropped is set, to the size in bytes of the original key
// and headers, on a dead-letter copy that was too large even without its
// value: it is written without the key and the original headers, with the
// diagnostic headers alone, each cut to maxDiagnostic bytes. It carries
// HeaderValueDropped too. The original record is still in its topic, at
// the partition and offset of the copy's headers.
const HeaderOriginalDropped = "once-original-dropped"

// maxDiagnostic bounds each diagnostic header of a copy written without
// its original key and headers: the error message and stack are cut to
// this already (consumer.DeadLetter.Headers), the event id and type are
// not when they are invalid ones.
const maxDiagnostic = 4096

// valueDropped is the HeaderValueDropped header of raw's copy.
func valueDropped(raw *sarama.ConsumerMessage) sarama.RecordHeader {
	return sarama.RecordHeader{Key: []byte(HeaderValueDropped), Value: []byte(strconv.Itoa(len(raw.Value)))}
}

// keyAndHeaderBytes is the size of raw's key and headers.
func keyAndHeaderBytes(raw *sarama.ConsumerMessage) int {
	n := len(raw.Key)
	for _, h := range raw.Headers {
		if h != nil {
			n += len(h.Key) + len(h.Value)
		}
	}
	return n
}

// cutDiagnostics cuts every value of diag to maxDiagnostic bytes of valid
// UTF-8.
func cutDiagnostics(diag map[string]string) map[string]string {
	for k, v := range diag {
		if len(v) > maxDiagnostic {
			diag[k] = strings.ToValidUTF8(v[:maxDiagnostic], "")
		}
	}
	return diag
}

// tooLarge reports whether a produce failed on the record's size, in the
// producer (Producer.MaxMessageBytes) or at the broker.
func tooLarge(err error) bool {
	if err == nil {
		return false
	}
	var cfgErr sarama.ConfigurationError
	return refusedForSize(err) || (errors.As(err, &cfgErr) && strings.Contains(string(cfgErr), "MaxMessageBytes"))
}

// refusedForSize reports whether the broker refused a produce for the
// size of its record batch: larger than message.max.bytes or the topic's
// max.message.bytes (MESSAGE_TOO_LARGE), or than the topic's segment.bytes
// (RECORD_LIST_TOO_LARGE), which a dead-letter topic given small segments,
// so that retention deletes its few records on time, may hold below a
// max.message.bytes raised for large dead letters.
func refusedForSize(err error) bool {
	return errors.Is(err, sarama.ErrMessageSizeTooLarge) || errors.Is(err, sarama.ErrMessageSetSizeTooLarge)
}

// send produces out and waits for the acknowledgement or ctx. With alone,
// no other send is in the producer meanwhile, so that out goes in a record
// batch of its own: a broker that refused a batch as too large is asked
// about out alone.
func (s *Source) send(ctx context.Context, out *sarama.ProducerMessage, alone bool) error {
	s.sendMu.Lock()
	if s.sendsClosed {
		s.sendMu.Unlock()
		return consumer.ErrSourceClosed
	}
	s.sends.Add(1)
	s.sending.Add(1)
	s.sendMu.Unlock()
	done := make(chan error, 1)
	go func() {
		defer s.sends.Done()
		defer s.sending.Add(-1)
		if alone {
			s.soloMu.Lock()
			defer s.soloMu.Unlock()
		} else {
			s.soloMu.RLock()
			defer s.soloMu.RUnlock()
		}
		_, _, err := s.producer.SendMessage(out)
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// deadLetterHeaders keeps the original headers, in order and with repeated
// keys, except those the diagnostics replace, then appends the diagnostics
// sorted by name.
func deadLetterHeaders(orig []*sarama.RecordHeader, diag map[string]string) []sarama.RecordHeader {
	out := make([]sarama.RecordHeader, 0, len(orig)+len(diag))
	for _, h := range orig {
		if h == nil {
			continue
		}
		if _, replaced := diag[string(h.Key)]; replaced {
			continue
		}
		out = append(out, sarama.RecordHeader{Key: h.Key, Value: h.Value})
	}
	keys := make([]string, 0, len(diag))
	for k := range diag {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		out = append(out, sarama.RecordHeader{Key: []byte(k), Value: []byte(diag[k])})
	}
	return out
}
