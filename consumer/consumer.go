package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Handler handles one event inside tx, the transaction in which the
// consumer claimed the event id. Write business rows through tx and nothing
// else: they commit together with the claim, exactly once per event id.
// Return nil to commit; return an error to roll back and retry per the
// retry policy (Permanent: dead-letter at once; RetryAfter: retry after a
// given delay). Do not commit or roll back tx yourself.
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
	// Payload is the decoded value (or the envelope's data).
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
// effect. Build it with New (one payload type) or NewRouted (a Router of
// typed handlers per event type), then call Run.
type Consumer[T any] struct {
	e *engine
}

// New returns a consumer that decodes every message into T and calls h.
// It fails with an error wrapping ErrInvalidConfig for a nil pool, source
// or handler and for an invalid cfg.
func New[T any](pool *pgxpool.Pool, src Source, h Handler[T], cfg Config) (*Consumer[T], error) {
	if h == nil {
		return nil, fmt.Errorf("%w: handler is nil", ErrInvalidConfig)
	}
	e, err := newEngine(pool, src, cfg, func(m *Message, idt identity, dec Decoder) (prepared, ErrorKind, error) {
		c, kind, err := bind(h, m, idt, dec)
		return prepared{call: c}, kind, err
	})
	if err != nil {
		return nil, err
	}
	return &Consumer[T]{e: e}, nil
}

// Run consumes until ctx is cancelled or the source fails. It first creates
// the dedup tables (unless Config.SkipMigrate) and returns that error if it
// fails. Once ctx is cancelled it stops receiving, lets messages in flight
// finish for up to Config.ShutdownTimeout (then rolls them back, unacked),
// closes the source (which flushes acknowledgements) and returns nil. A
// fatal source error is returned after the same shutdown. Run may be
// called once.
func (c *Consumer[T]) Run(ctx context.Context) error { return c.e.run(ctx) }

// Stats returns the consumer's counters. It is safe to call at any time
// from any goroutine.
func (c *Consumer[T]) Stats() Stats { return c.e.stats.snapshot() }

// call runs a decoded message's handler in tx.
type call func(ctx context.Context, tx pgx.Tx, attempt int) error

// prepared is a message decoded for its handler. A nil call means: record
// the id without running a handler.
type prepared struct {
	call call
	// event is the typed Event, for a BatchHandler.
	event any
}

// preparer decodes a message for its handler.
type preparer func(m *Message, idt identity, dec Decoder) (prepared, ErrorKind, error)

func bind[T any](h Handler[T], m *Message, idt identity, dec Decoder) (call, ErrorKind, error) {
	payload, err := decodeAs[T](idt.payload, dec)
	if err != nil {
		return nil, KindDecode, &DecodeError{Err: err}
	}
	return func(ctx context.Context, tx pgx.Tx, attempt int) error {
		q := openQueue(tx)
		defer q.close()
		return h(ctx, tx, Event[T]{ID: idt.id, Type: idt.typ, Payload: payload, Message: m, Attempt: attempt, queue: q})
	}, "", nil
}

func decodeAs[T any](data []byte, dec Decoder) (T, error) {
	var v T
	if b, ok := any(&v).(*[]byte); ok {
		*b = data
		return v, nil
	}
	err := dec(data, &v)
	return v, err
}

type engine struct {
	cfg     Config
	pool    *pgxpool.Pool
	src     Source
	prepare preparer
	// batchCall, set for a BatchHandler, runs the handler once for the
	// claimed jobs of a batch.
	batchCall func(ctx context.Context, tx pgx.Tx, jobs []*job) error
	tel       *telemetry
	stats     counters
	sem       chan struct{}
	started   atomic.Bool
	// stopping is set once Run's context is done: no new message starts,
	// and a batch in progress is rolled back.
	stopping atomic.Bool
	// suspectMu serialises the handling of messages that may have crashed
	// a process (see handle).
	suspectMu sync.Mutex
}

func newEngine(pool *pgxpool.Pool, src Source, cfg Config, prep preparer) (*engine, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: pool is nil", ErrInvalidConfig)
	}
	if src == nil {
		return nil, fmt.Errorf("%w: source is nil", ErrInvalidConfig)
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	system := "unknown"
	if n, ok := src.(SystemNamer); ok {
		system = n.MessagingSystem()
	}
	tel, err := newTelemetry(&cfg, system)
	if err != nil {
		return nil, fmt.Errorf("once: telemetry: %w", err)
	}
	return &engine{cfg: cfg, pool: pool, src: src, prepare: prep, tel: tel, sem: make(chan struct{}, cfg.Concurrency)}, nil
}

// prepareSchema migrates the store's tables, or, when the user manages
// them (SkipMigrate), checks their shape, so that a table of another shape
// fails Run at once instead of every claim.
func (e *engine) prepareSchema(ctx context.Context) error {
	if e.cfg.SkipMigrate {
		return e.cfg.Store.Check(ctx, e.pool)
	}
	return e.cfg.Store.Migrate(ctx, e.pool)
}

// dispatcher routes deliveries to workers: one lane per stream, so a
// stream's messages are handled in order, and a shared pool of workers for
// deliveries without a stream.
type dispatcher struct {
	e     *engine
	work  context.Context
	wg    sync.WaitGroup
	lanes map[string]*lane
	// budget holds a token for each delivery waiting in a lane: receiving
	// blocks while Config.ReceiveBuffer deliveries wait.
	budget    chan struct{}
	unordered chan Delivery
}

func (e *engine) run(ctx context.Context) error {
	if !e.started.CompareAndSwap(false, true) {
		return errors.New("once: Run called twice")
	}
	if err := e.prepareSchema(ctx); err != nil {
		_ = e.src.Close()
		if ctx.Err() != nil {
			return nil // stopped during start-up
		}
		return fmt.Errorf("once: consumer %q: %w", e.cfg.Name, err)
	}
	// In-flight work outlives ctx by up to ShutdownTimeout.
	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	d := &dispatcher{e: e, work: work, lanes: map[string]*lane{},
		budget: make(chan struct{}, e.cfg.ReceiveBuffer), unordered: make(chan Delivery, e.cfg.ReceiveBuffer)}
	for i := 0; i < e.cfg.Concurrency; i++ {
		d.wg.Add(1)
		go d.unorderedWorker()
	}
	if e.cfg.RetentionMaxAge > 0 {
		go e.retention(ctx)
	}

	fatal := d.receive(ctx)

	e.stopping.Store(true)
	for _, l := range d.lanes {
		l.close()
	}
	close(d.unordered)
	if !waitTimeout(&d.wg, e.cfg.ShutdownTimeout) {
		e.cfg.Logger.Warn("once: shutdown timeout: rolling back messages in flight; they will be redelivered",
			"consumer", e.cfg.Name, "timeout", e.cfg.ShutdownTimeout)
		cancelWork()
		d.wg.Wait()
	}
	if err := e.src.Close(); err != nil {
		return errors.Join(fatal, fmt.Errorf("once: closing source: %w", err))
	}
	return fatal
}

// receive feeds deliveries to workers until ctx is done or the source
// fails; it returns the source's fatal error, if any.
func (d *dispatcher) receive(ctx context.Context) error {
	for {
		dv, err := d.e.src.Receive(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("once: consumer %q: receive: %w", d.e.cfg.Name, err)
		}
		d.e.stats.received.Add(1)
		if !d.dispatch(ctx, dv) {
			return nil // dv is abandoned unacked: the broker redelivers it
		}
	}
}

// dispatch queues dv for its lane, or for the unordered workers, once the
// budget allows; it reports false if ctx ended first.
func (d *dispatcher) dispatch(ctx context.Context, dv Delivery) bool {
	stream := dv.Message().Stream
	if stream == "" {
		select {
		case d.unordered <- dv:
			return true
		case <-ctx.Done():
			return false
		}
	}
	select {
	case d.budget <- struct{}{}:
		d.lane(stream).push(dv)
		return true
	case <-ctx.Done():
		return false
	}
}

func (d *dispatcher) lane(stream string) *lane {
	l, ok := d.lanes[stream]
	if !ok {
		l = newLane()
		d.lanes[stream] = l
		d.wg.Add(1)
		go d.orderedWorker(l)
	}
	return l
}

// orderedWorker handles one stream's deliveries in order, in batches.
//
// After each new assignment of the stream (a new Delivery.Context), the
// first BatchSize new messages are handled under guard (runGuarded): one
// of them was in flight if the previous owner died, and a durable attempt
// count is how a message that kills the process every time ends in the
// dead-letter queue (Config.MaxCrashAttempts) instead of crash-looping the
// service. Later messages need no bookkeeping.
func (d *dispatcher) orderedWorker(l *lane) {
	defer d.wg.Done()
	var assignment context.Context
	guard := 0
	for {
		batch := l.next(d.e.cfg.BatchSize, d.e.linger())
		if batch == nil {
			return
		}
		for range batch {
			<-d.budget
		}
		for len(batch) > 0 && !d.e.stopping.Load() {
			dv := batch[0]
			if c := dv.Context(); c != assignment {
				assignment, guard = c, d.e.cfg.BatchSize
			}
			if mayBeRedelivery(dv) {
				d.e.handle(d.work, dv, true)
				batch = batch[1:]
				continue
			}
			n := 1
			for n < len(batch) && batch[n].Context() == assignment && !mayBeRedelivery(batch[n]) {
				n++
			}
			guard -= d.e.handleBatch(d.work, batch[:n], guard > 0)
			batch = batch[n:]
		}
	}
}

// unorderedWorker handles deliveries without a stream, batching what is
// waiting; messages the broker marks redelivered are handled alone with a
// durable attempt count.
func (d *dispatcher) unorderedWorker() {
	defer d.wg.Done()
	for first := range d.unordered {
		if d.e.stopping.Load() {
			continue
		}
		batch := d.e.collect(first, d.unordered)
		plain := batch[:0]
		for _, dv := range batch {
			if mayBeRedelivery(dv) {
				d.e.handle(d.work, dv, true)
			} else {
				plain = append(plain, dv)
			}
		}
		// A batch shares one fate, so it must not mix deliveries of
		// different channels: abandoning a batch because one channel died
		// would leave the others' deliveries unacked on a live channel.
		for len(plain) > 0 && !d.e.stopping.Load() {
			n := 1
			for n < len(plain) && plain[n].Context() == plain[0].Context() {
				n++
			}
			d.e.handleBatch(d.work, plain[:n], false)
			plain = plain[n:]
		}
	}
}

func mayBeRedelivery(dv Delivery) bool {
	m := dv.Message()
	return m.Redelivered || m.DeliveryCount > 0
}
