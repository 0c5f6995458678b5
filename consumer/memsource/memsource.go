// Package memsource is an in-memory consumer.Source for unit tests of code
// built on the consumer: a broker-like log with streams (ordered lanes),
// acks, a dead-letter list, and redelivery of unacked messages to the next
// Source opened on the same Broker. It is not a message broker: nothing
// survives the process.
package memsource

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"sync"

	"github.com/onceco/once/consumer"
)

// Broker holds published messages, their acks and the dead letters. It is
// safe for concurrent use.
type Broker struct {
	mu     sync.Mutex
	topic  string
	log    []*consumer.Message
	acked  map[int64]bool
	dead   []DeadLetter
	notify chan struct{}
	// ackNotify is closed and replaced on every ack.
	ackNotify chan struct{}
	fallback  bool
	streams   int
	// deadErr, when non-nil, makes every DeadLetter call fail with it
	// (SetDeadLetterError).
	deadErr error
}

// DeadLetter is a message written to the broker's dead-letter list.
type DeadLetter struct {
	// Message is the message dead-lettered, as it was published.
	Message consumer.Message
	// Headers are the copy's headers: the message's own, with the
	// diagnostic headers of consumer.DeadLetter.Headers (once-error-kind,
	// once-event-id, ...) written over them.
	Headers map[string]string
}

// Options configure a Broker.
type Options struct {
	// Topic names the messages' Topic; streams are Topic/key-hash.
	// Defaults to "mem".
	Topic string
	// Streams is the number of ordered lanes messages are spread over by
	// key (like Kafka partitions). Defaults to 0: unordered (empty Stream).
	Streams int
	// FallbackID gives every message a FallbackID of topic/offset.
	// Defaults to false.
	FallbackID bool
}

// New returns an empty broker.
func New(opts Options) *Broker {
	if opts.Topic == "" {
		opts.Topic = "mem"
	}
	b := &Broker{topic: opts.Topic, acked: map[int64]bool{}, notify: make(chan struct{}), ackNotify: make(chan struct{}),
		fallback: opts.FallbackID}
	b.streams = opts.Streams
	return b
}

// Publish appends a copy of a message (its key, value and headers too: the
// caller may reuse them). Key decides its stream when the broker has
// streams. The message's Topic, Offset, Partition and Stream are set here
// (no Stream on a broker without streams, whatever the caller's copy
// said). Redelivered is kept: set, the first delivery too stands for a
// redelivery.
func (b *Broker) Publish(m consumer.Message) {
	m.Key, m.Value = bytes.Clone(m.Key), bytes.Clone(m.Value)
	b.mu.Lock()
	defer b.mu.Unlock()
	m.Topic = b.topic
	m.Offset = int64(len(b.log))
	m.Partition, m.Stream = -1, ""
	if b.streams > 0 {
		m.Partition = int32(hashKey(m.Key) % uint32(b.streams))
		m.Stream = fmt.Sprintf("%s/%d", b.topic, m.Partition)
	}
	if b.fallback {
		m.FallbackID = fmt.Sprintf("%s/%d", b.topic, m.Offset)
	}
	m.Headers = maps.Clone(m.Headers)
	b.log = append(b.log, &m)
	close(b.notify)
	b.notify = make(chan struct{})
}

// SetDeadLetterError makes DeadLetter calls fail with err (nil: succeed),
// to stand for a dead-letter destination that is down.
func (b *Broker) SetDeadLetterError(err error) {
	b.mu.Lock()
	b.deadErr = err
	b.mu.Unlock()
}

// Acked reports how many messages are acked.
func (b *Broker) Acked() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.acked)
}

// Published reports how many messages were published.
func (b *Broker) Published() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.log)
}

// WaitAcked blocks until at least n messages are acked (a dead-lettered
// message is acked once its copy is written), or ctx ends; then it returns
// ctx's error.
func (b *Broker) WaitAcked(ctx context.Context, n int) error {
	for {
		b.mu.Lock()
		acked, changed := len(b.acked), b.ackNotify
		b.mu.Unlock()
		if acked >= n {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("memsource: %d of %d messages acked: %w", acked, n, ctx.Err())
		case <-changed:
		}
	}
}

// WaitEachAcked blocks until each of the first n messages published (the
// offsets below n) is acked, or ctx ends; then it returns ctx's error.
// Unlike WaitAcked, acks of messages published later do not count.
func (b *Broker) WaitEachAcked(ctx context.Context, n int) error {
	var next int64 // the offsets below it are acked
	for {
		b.mu.Lock()
		for next < int64(n) && b.acked[next] {
			next++
		}
		changed := b.ackNotify
		b.mu.Unlock()
		if next >= int64(n) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("memsource: offset %d of the first %d messages not acked: %w", next, n, ctx.Err())
		case <-changed:
		}
	}
}

// IsAcked reports whether the message at offset is acked.
func (b *Broker) IsAcked(offset int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.acked[offset]
}

// DeadLetters returns the dead letters so far, in the order written.
func (b *Broker) DeadLetters() []DeadLetter {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]DeadLetter(nil), b.dead...)
}

// Source opens a consumer on the broker. It delivers every message not yet
// acked, in offset order (so unacked messages of an earlier Source are
// redelivered, with Redelivered set), then new ones as they are published.
// Close the earlier Source first: two open sources would both get them.
func (b *Broker) Source() *Source {
	ctx, cancel := context.WithCancel(context.Background())
	return &Source{b: b, ctx: ctx, cancel: cancel, delivered: map[int64]bool{}}
}

// Source is a consumer.Source on a Broker.
type Source struct {
	b         *Broker
	ctx       context.Context
	cancel    context.CancelFunc
	next      int64
	delivered map[int64]bool
	closed    bool
	mu        sync.Mutex
}

// MessagingSystem implements consumer.SystemNamer.
func (s *Source) MessagingSystem() string { return "memory" }

// Receive implements consumer.Source.
func (s *Source) Receive(ctx context.Context) (consumer.Delivery, error) {
	for {
		s.mu.Lock()
		closed := s.closed
		s.mu.Unlock()
		if closed {
			return nil, consumer.ErrSourceClosed
		}
		b := s.b
		b.mu.Lock()
		for s.next < int64(len(b.log)) && b.acked[s.next] {
			s.next++
		}
		if s.next < int64(len(b.log)) {
			// A copy, as a real broker's delivery is: what a handler
			// does to it stays out of the log.
			m := *b.log[s.next]
			m.Key, m.Value, m.Headers = bytes.Clone(m.Key), bytes.Clone(m.Value), maps.Clone(m.Headers)
			m.Redelivered = b.log[s.next].Redelivered
			b.log[s.next].Redelivered = true // any later delivery is a redelivery
			s.next++
			b.mu.Unlock()
			return &delivery{s: s, m: &m, redelivered: m.Redelivered}, nil
		}
		wait := b.notify
		b.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-s.ctx.Done():
			return nil, consumer.ErrSourceClosed
		case <-wait:
		}
	}
}

// Close implements consumer.Source. Deliveries not acked stay in the
// broker for the next Source.
func (s *Source) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	return nil
}

type delivery struct {
	s *Source
	m *consumer.Message
	// redelivered is m.Redelivered as delivered, for the dead letter.
	redelivered bool
}

func (d *delivery) Message() *consumer.Message { return d.m }
func (d *delivery) Context() context.Context   { return d.s.ctx }

func (d *delivery) Ack(ctx context.Context) error {
	if d.s.ctx.Err() != nil {
		return fmt.Errorf("memsource: ack after close of offset %d", d.m.Offset)
	}
	b := d.s.b
	b.mu.Lock()
	b.acked[d.m.Offset] = true
	close(b.ackNotify)
	b.ackNotify = make(chan struct{})
	b.mu.Unlock()
	return nil
}

func (d *delivery) DeadLetter(ctx context.Context, dl *consumer.DeadLetter) error {
	if dl == nil {
		// A copy that says nothing of why would be written, then acked:
		// refused, as the Kafka source refuses it.
		return fmt.Errorf("memsource: DeadLetter of offset %d called with a nil *consumer.DeadLetter", d.m.Offset)
	}
	if d.s.ctx.Err() != nil {
		return fmt.Errorf("memsource: dead letter after close of offset %d", d.m.Offset)
	}
	b := d.s.b
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.deadErr != nil {
		return b.deadErr
	}
	// The copy is made from the message as published, as Kafka's is from
	// the record it read: a handler that changed its delivery (which the
	// consumer's docs forbid) changes no dead letter.
	m := *b.log[d.m.Offset]
	m.Key, m.Value, m.Headers = bytes.Clone(m.Key), bytes.Clone(m.Value), maps.Clone(m.Headers)
	m.Redelivered = d.redelivered
	h := maps.Clone(m.Headers)
	if h == nil {
		h = map[string]string{}
	}
	maps.Copy(h, dl.Headers(&m))
	b.dead = append(b.dead, DeadLetter{Message: m, Headers: h})
	return nil
}

func hashKey(k []byte) uint32 {
	h := uint32(2166136261)
	for _, c := range k {
		h = (h ^ uint32(c)) * 16777619
	}
	return h
}
