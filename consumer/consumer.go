package consumer

import (
	"context"
	"fmt"
	"reflect"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Handler handles one event inside tx, the transaction in which the
// consumer claimed the event id. Write business rows through tx and nothing
// else: they commit together with the claim, exactly once per event id.
// Return nil to commit; return an error to roll back and retry per the
// retry policy (Permanent: dead-letter at once; RetryAfter: retry after a
// given delay). tx's Commit and Rollback are refused with
// ErrTxOwnedByConsumer, which fails the message permanently; so does
// ending tx with a statement (COMMIT, END, ROLLBACK, ABORT through Exec;
// also COMMIT AND CHAIN, or COMMIT; BEGIN in one string, which leave the
// connection in another transaction), after which what the handler sends
// through tx is refused. A statement that may end tx costs a round trip
// before it and one after, to tell; tx.Begin (a savepoint) works as usual.
// tx is the handler's for the call only: used after the handler returned
// (from a goroutine it started), it fails with an error wrapping
// pgx.ErrTxClosed.
//
// A handler runs for one message at a time per stream, and for up to
// Config.Concurrency messages at once overall. Effects outside tx (HTTP
// calls, publishes) happen at least once: make them idempotent with the
// event id (see docs/guarantees.md).
type Handler[T any] func(ctx context.Context, tx pgx.Tx, ev Event[T]) error

// Event is a decoded message as a handler sees it.
type Event[T any] struct {
	// ID is the event id claimed for this message.
	ID string
	// Type is the event type; empty when the message carries none.
	Type string
	// Payload is the decoded value (or the envelope's data). Each run of
	// the handler gets it as the message holds it, decoded again after
	// the first: what a run that was rolled back changed in place is not
	// seen by the next. A []byte payload is the message's own bytes; do
	// not modify it.
	Payload T
	// Message is the broker message: topic, partition, offset, key,
	// headers, timestamp. Do not modify it.
	Message *Message
	// Attempt is 1 on the first run of the handler for this message, and
	// counts retries and, where the consumer can tell, runs cut short by
	// a crash of the process.
	Attempt int

	// queue is where Queue puts statements, while the handler runs.
	queue *eventQueue
}

// Consumer consumes one Source, handling each message exactly once in
// effect. Build it with New (one payload type), NewRouted (a Router of
// typed handlers per event type) or NewBatch (a BatchHandler given whole
// batches), then call Run.
type Consumer[T any] struct {
	p *pipeline
}

// New returns a consumer that decodes every message into T and calls h.
// It fails with an error wrapping ErrInvalidConfig for a nil pool, source
// (also a nil pointer in the Source: that of an Open whose error was
// dropped) or handler, for an invalid cfg, and for a T that is an
// interface with methods while cfg has no Decoder (the default JSON
// decoder cannot fill one; route such a family with NewRouted), and with one wrapping ErrSourceBroken
// when the source's MessagingSystem (SystemNamer), ConsumerGroup
// (GroupNamer), BoundsStreams (StreamBounder) or DeliveryLimit
// (DeliveryLimiter), which New asks for,
// panics. The consumer resets pool
// (pgxpool.Pool.Reset) when the database refuses one of its writes as
// read-only (25006, after a failover): pool's connections, which other
// users of it share, may reach a server that is read-only now.
func New[T any](pool *pgxpool.Pool, src Source, h Handler[T], cfg Config) (*Consumer[T], error) {
	if h == nil {
		return nil, fmt.Errorf("%w: handler is nil", ErrInvalidConfig)
	}
	if err := decodable[T](cfg); err != nil {
		return nil, err
	}
	p, err := newPipeline(pool, src, cfg, func(m *Message, idt identity, dec Decoder) (prepared, ErrorKind, error) {
		c, kind, err := bind(h, m, idt, dec)
		return prepared{call: c}, kind, err
	})
	if err != nil {
		return nil, err
	}
	return &Consumer[T]{p: p}, nil
}

// Run consumes until ctx is cancelled or the source fails. It first creates
// the dedup tables (unless Config.SkipMigrate; then it checks them) and
// returns that error if it fails for a reason retrying cannot cure (a
// table of another shape, a password or a permission refused); a database
// that is down or restarting is waited for, retried after
// Config.InfraBackoff and logged, and when ctx ends first Run returns the
// last such failure (a wrong address looks the same). Once ctx is cancelled it stops receiving, lets messages in flight
// finish for up to Config.ShutdownTimeout (then rolls them back, unacked),
// closes the source (which flushes acknowledgements) and returns nil, or
// the source's Close error (a panic in Close too, wrapping
// ErrSourceBroken). A fatal source error is returned after the same
// shutdown. Run may be called once. On a Consumer not built by New,
// NewRouted or NewBatch (nil, as a constructor whose error was dropped
// leaves it, or the zero value) it fails at once with an error wrapping
// ErrInvalidConfig.
func (c *Consumer[T]) Run(ctx context.Context) error {
	if c == nil || c.p == nil {
		return fmt.Errorf("%w: Run on a Consumer not built by New, NewRouted or NewBatch (was a constructor's error dropped?)", ErrInvalidConfig)
	}
	return c.p.consume(ctx)
}

// Stats returns the consumer's counters. It is safe to call at any time
// from any goroutine. A Consumer not built by New, NewRouted or NewBatch
// has none: its Stats are zero.
func (c *Consumer[T]) Stats() Stats {
	if c == nil || c.p == nil {
		return Stats{}
	}
	return c.p.stats.snapshot()
}

// decodable refuses a payload type T that is an interface with methods
// when cfg has no Decoder: the default JSON decoder cannot fill a nil
// interface, and every message would be dead-lettered as decode. Such a T
// is an event family, which NewRouted takes. A Decoder of the service's
// own may fill it.
func decodable[T any](cfg Config) error {
	t := reflect.TypeFor[T]()
	if decodableBy(t, cfg) {
		return nil
	}
	return fmt.Errorf("%w: the payload type %v is an interface, which the default JSON decoder cannot decode into "+
		"(every message would be dead-lettered): decode into a concrete type, route an event family with NewRouted, or set Decoder", ErrInvalidConfig, t)
}

// decodableBy reports whether cfg's Decoder may fill a payload of type t:
// the default JSON decoder cannot fill an interface with methods.
func decodableBy(t reflect.Type, cfg Config) bool {
	return cfg.Decoder != nil || t.Kind() != reflect.Interface || t.NumMethod() == 0
}

// call runs a decoded message's handler in tx. q is the transaction's
// write queue (Event.Queue), given apart from tx: a middleware may hand the
// handler a tx of its own around q. again says that the handler ran with
// the message before (see runPayload). An interface rather than a func, so
// that a message decoded for its handler is one allocation (bound,
// batchBound) and not a closure beside the payload.
type call interface {
	run(ctx context.Context, tx pgx.Tx, q *queueTx, attempt int, again bool) error
}

// prepared is a message decoded for its handler. A nil call means: record
// the id without running a handler.
type prepared struct {
	call call
	// event is the typed *Event, for a BatchHandler.
	event any
}

// preparer decodes a message for its handler.
type preparer func(m *Message, idt identity, dec Decoder) (prepared, ErrorKind, error)

// bound is a message decoded for its Handler, its payload decoded in place.
type bound[T any] struct {
	h       Handler[T]
	m       *Message
	idt     identity
	dec     Decoder
	payload T
}

func bind[T any](h Handler[T], m *Message, idt identity, dec Decoder) (call, ErrorKind, error) {
	b := &bound[T]{h: h, m: m, idt: idt, dec: dec}
	if err := decodeInto(&b.payload, idt.payload, dec); err != nil {
		return nil, KindDecode, &DecodeError{Err: err}
	}
	return b, "", nil
}

func (b *bound[T]) run(ctx context.Context, tx pgx.Tx, qtx *queueTx, attempt int, again bool) error {
	p, err := runPayload(b.payload, again, b.idt.payload, b.dec)
	if err != nil {
		return err
	}
	q := openQueue(qtx)
	defer q.close()
	return b.h(ctx, tx, Event[T]{ID: b.idt.id, Type: b.idt.typ, Payload: p, Message: b.m, Attempt: attempt, queue: q})
}

// runPayload returns the payload for a run of a handler: decoded, the
// payload identify decoded for the first run, and a new decoding of data
// for a later one (again), since the handler may have changed the payload
// in place (through a pointer, a map or a slice in it) in a run that was
// rolled back: a retry, or a batch run again for another message's
// failure. Its error, which the first decoding of the same data did not
// meet, is the handler's failure.
func runPayload[T any](decoded T, again bool, data []byte, dec Decoder) (T, error) {
	if !again {
		return decoded, nil
	}
	v, err := decodeAs[T](data, dec)
	if err != nil {
		return v, fmt.Errorf("decoding the payload again for another run: %w", err)
	}
	return v, nil
}

func decodeAs[T any](data []byte, dec Decoder) (T, error) {
	var v T
	err := decodeInto(&v, data, dec)
	return v, err
}

// decodeInto decodes data into *v; a []byte payload is data itself.
func decodeInto[T any](v *T, data []byte, dec Decoder) error {
	if b, ok := any(v).(*[]byte); ok {
		*b = data
		return nil
	}
	return dec(data, v)
}
