package kafkaout

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/rcrowley/go-metrics"

	"github.com/onceco/once/internal/kafkaaddr"
	"github.com/onceco/once/internal/kafkarefusal"
	"github.com/onceco/once/outbox"
)

// Default header names, the ones the consuming side of this library reads
// by default (consumer.Config.Identify.IDHeaders and TypeHeaders).
const (
	DefaultIDHeader   = "id"
	DefaultTypeHeader = "type"
)

// Config configures a Publisher. Brokers is required.
type Config struct {
	// Brokers are the bootstrap broker addresses ("host:port"). Required;
	// New refuses an address without a port.
	Brokers []string
	// Sarama is the base client configuration (TLS, SASL, Version,
	// ClientID, Producer.MaxMessageBytes, Producer.Partitioner, retries,
	// compression). Nil means sarama.NewConfig(). New copies it and
	// overrides what the outbox's promises rest on: the producer is
	// idempotent with RequiredAcks = WaitForAll and Net.MaxOpenRequests =
	// 1 (so retries neither duplicate nor reorder a partition's records),
	// returns successes and errors, is not transactional (Transaction.ID
	// is cleared), sends each batch at once (the Producer.Flush triggers
	// are cleared: a batch smaller than one would wait on it), runs no
	// Producer.Interceptors (headers they added after Check could make a
	// record too large, and would replace the row's trace context), and
	// never asks the broker to create a topic. Version
	// must be at least 0.11 (sarama.V0_11_0_0). Producer.Partitioner
	// must keep a key on one partition (RequiresConsistency): New refuses
	// a random or round-robin one, which would break a key's order. The
	// producer dials
	// through Net.Proxy.Dialer when Net.Proxy.Enable is set, else through
	// a net.Dialer of the Net settings, wrapped so that Close can end a
	// connect in flight (sarama's Logger then says "using proxy").
	Sarama *sarama.Config
	// IDHeader is the header that carries the event id. Defaults to "id".
	IDHeader string
	// TypeHeader carries the event type, when the message has one.
	// Defaults to "type". It must differ from IDHeader.
	TypeHeader string
}

// Publisher publishes outbox records to Kafka with an idempotent sarama
// producer, a batch at a time, and reports each record's outcome once every
// in-sync replica has it (acks=all). It connects on first use and again
// after a failure, so a relay can start while Kafka is down. Use it from
// one goroutine (the relay's); Close may be called from any.
type Publisher struct {
	cfg Config
	sc  *sarama.Config

	mu       sync.Mutex
	producer sarama.SyncProducer
	// connecting is the connect in flight, nil when none (connect).
	connecting *connecting
	closed     bool
}

// connecting is a connect in flight: the producer or the error it ended
// with, set before done is closed. Close ends it through dialer (its
// connections) and cancel (the probe of a failed connect).
type connecting struct {
	done     chan struct{}
	producer sarama.SyncProducer
	err      error
	dialer   *connectDialer
	ctx      context.Context
	cancel   context.CancelFunc
}

// dialer is what sarama dials brokers with (Config.Net.Proxy.Dialer).
type dialer interface {
	Dial(network, addr string) (net.Conn, error)
}

// contextDialer is a dialer that takes a context (golang.org/x/net/proxy's
// ContextDialer), which sarama uses to resolve canonical bootstrap names.
type contextDialer interface {
	DialContext(ctx context.Context, network, addr string) (net.Conn, error)
}

// connectDialer dials the connections of one connect through the dialer
// sarama would use, and keeps them until the connect ends, so that Close
// can close them: sarama's NewSyncProducer takes no context, and against
// a broker that never answers it goes on for its read timeout times its
// metadata retries (minutes with sarama's defaults). The producer made
// keeps dialing through it, without it keeping its connections.
type connectDialer struct {
	base  dialer
	mu    sync.Mutex
	conns map[net.Conn]struct{}
	// sealed is set when the connect has ended: later connections (the
	// producer's) are not kept. cut is set by Close: dials fail.
	sealed, cut bool
}

// newConnectDialer wraps the dialer sarama would use with sc.
func newConnectDialer(sc *sarama.Config) *connectDialer {
	var base dialer
	if sc.Net.Proxy.Enable {
		base = sc.Net.Proxy.Dialer
	} else {
		base = &net.Dialer{Timeout: sc.Net.DialTimeout, KeepAlive: sc.Net.KeepAlive, LocalAddr: sc.Net.LocalAddr}
	}
	return &connectDialer{base: base, conns: map[net.Conn]struct{}{}}
}

// Dial dials addr through the base dialer.
func (d *connectDialer) Dial(network, addr string) (net.Conn, error) {
	return d.DialContext(context.Background(), network, addr)
}

// DialContext dials addr through the base dialer, with ctx when it takes
// one, and keeps the connection while the connect is in flight.
func (d *connectDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	var (
		conn net.Conn
		err  error
	)
	if cd, ok := d.base.(contextDialer); ok {
		conn, err = cd.DialContext(ctx, network, addr)
	} else {
		conn, err = d.base.Dial(network, addr)
	}
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cut {
		_ = conn.Close()
		return nil, errClosed
	}
	if d.sealed {
		return conn, nil
	}
	tc := &trackedConn{Conn: conn, d: d}
	d.conns[tc] = struct{}{}
	return tc, nil
}

// seal stops keeping connections: the connect has ended.
func (d *connectDialer) seal() {
	d.mu.Lock()
	d.sealed = true
	d.conns = nil
	d.mu.Unlock()
}

// cutAll closes the connections of the connect in flight and fails its
// later dials, so that sarama gives the connect up at once.
func (d *connectDialer) cutAll() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.sealed {
		return
	}
	d.cut = true
	for c := range d.conns {
		_ = c.(*trackedConn).Conn.Close()
	}
	d.conns = nil
}

// trackedConn leaves its dialer's set when closed.
type trackedConn struct {
	net.Conn
	d *connectDialer
}

// Close closes the connection and forgets it.
func (c *trackedConn) Close() error {
	c.d.mu.Lock()
	delete(c.d.conns, c)
	c.d.mu.Unlock()
	return c.Conn.Close()
}

// New validates cfg and returns a Publisher; it does not connect yet.
func New(cfg Config) (*Publisher, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("kafkaout: Config.Brokers is empty")
	}
	// An address that can never be dialled would be retried as a broker
	// down, without end.
	if err := kafkaaddr.Check("kafkaout", "Config.Brokers", cfg.Brokers); err != nil {
		return nil, err
	}
	if cfg.IDHeader == "" {
		cfg.IDHeader = DefaultIDHeader
	}
	if cfg.TypeHeader == "" {
		cfg.TypeHeader = DefaultTypeHeader
	}
	if cfg.IDHeader == cfg.TypeHeader {
		// A typed record would carry the header twice, the type last,
		// which a consumer reads as the id.
		return nil, fmt.Errorf("kafkaout: Config.IDHeader and Config.TypeHeader are both %q: the type would be read as the event id", cfg.IDHeader)
	}
	sc := producerConfig(cfg.Sarama)
	if !sc.Version.IsAtLeast(sarama.V0_11_0_0) {
		return nil, fmt.Errorf("kafkaout: Config.Sarama.Version %s is older than 0.11.0.0 (the idempotent producer and headers need 0.11)", sc.Version)
	}
	if err := sc.Validate(); err != nil {
		return nil, fmt.Errorf("kafkaout: Config.Sarama: %w", err)
	}
	if sc.Producer.Partitioner != nil && !sc.Producer.Partitioner("").RequiresConsistency() {
		// A partitioner that does not place a key on one partition
		// (random, round robin) spreads the rows of one key over
		// partitions: their consumers would see them out of order.
		return nil, errors.New("kafkaout: Config.Sarama.Producer.Partitioner does not place a key on one partition (RequiresConsistency is false): " +
			"the rows of a key would lose their order; use a hash partitioner (the default)")
	}
	return &Publisher{cfg: cfg, sc: sc}, nil
}

// producerConfig copies base and sets what the guarantees depend on.
func producerConfig(base *sarama.Config) *sarama.Config {
	var sc sarama.Config
	if base != nil {
		sc = *base
	} else {
		sc = *sarama.NewConfig()
	}
	sc.MetricRegistry = metrics.NewRegistry()
	sc.Producer.Idempotent = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Return.Successes = true
	sc.Producer.Return.Errors = true
	if sc.Producer.Retry.Max < 1 {
		sc.Producer.Retry.Max = 1
	}
	sc.Net.MaxOpenRequests = 1
	// The producer is idempotent, not transactional: a transactional one
	// refuses every send made outside a transaction, and the relay would
	// retry them without end.
	sc.Producer.Transaction.ID = ""
	// No flush trigger: a batch is sent as one call and waited for, so a
	// trigger set for batching (Flush.Messages or Flush.Bytes, which a
	// batch smaller than it never meets) held it until Flush.Frequency,
	// or for ever without one, and each Publish ran to its deadline.
	// sarama still gathers the records queued while a request is in
	// flight into the next one.
	sc.Producer.Flush.Messages, sc.Producer.Flush.Bytes, sc.Producer.Flush.Frequency = 0, 0, 0
	// No interceptor: those of the base instrument the service's own
	// producers, and headers they add after Check (OpenTelemetry's
	// traceparent of its own span, in place of the row's) made a record
	// Check took too large for sarama, refused alone while the next of
	// its key went on, and replaced the trace context the row carries.
	sc.Producer.Interceptors = nil
	sc.Metadata.AllowAutoTopicCreation = false
	return &sc
}

// Publish sends recs as one batch and waits for the broker's answer to
// each. A record the broker or the client refuses for what it is (unknown
// topic, too large, not authorised, invalid, a timestamp (the row's
// CreatedAt) outside the topic's bounds) gets an error wrapped with
// outbox.Rejected; any other failure (no broker reachable, timeouts, not
// enough replicas) an ordinary error, after which the producer is closed
// and a new one (with a new producer id) is made for the next batch. A
// broker refusing the TLS or SASL settings of Config.Sarama, or the
// cluster refusing the producer its authorisation, is an error wrapped
// with outbox.Refused, which names the broker and what it refused: the
// relay retries it as well (and resumes once the settings or the cluster
// are fixed), logging it as an error. Publish returns when ctx ends (the
// relay's RelayConfig.PublishTimeout), each record failed with an error
// wrapping ctx's, a passing failure: the producer is given up and the
// records are sent again by the next call, with their ids. The same holds
// while connecting (the producer's first metadata request): the connect
// goes on aside, bounded by Config.Sarama's Net and Metadata settings
// (or until Close), and the next call waits for it or takes the producer
// it made.
func (p *Publisher) Publish(ctx context.Context, recs []outbox.Record) []error {
	producer, err := p.connect(ctx)
	if err != nil {
		return fill(len(recs), err)
	}
	msgs := make([]*sarama.ProducerMessage, len(recs))
	for i, rec := range recs {
		msgs[i] = p.message(rec)
		msgs[i].Metadata = i
	}
	err = p.send(ctx, producer, msgs)
	if err == nil {
		return nil
	}
	var perrs sarama.ProducerErrors
	if !errors.As(err, &perrs) {
		p.reset()
		return fill(len(recs), err)
	}
	errs := make([]error, len(recs))
	unavailable := false
	for _, pe := range perrs {
		i, ok := pe.Msg.Metadata.(int)
		if !ok || i < 0 || i >= len(recs) {
			continue
		}
		switch {
		case isRejection(pe.Err):
			errs[i] = outbox.Rejected(fmt.Errorf("kafkaout: topic %q: %w", recs[i].Topic, pe.Err))
		case isRefusal(pe.Err):
			errs[i] = outbox.Refused(fmt.Errorf("kafkaout: topic %q: %w", recs[i].Topic, pe.Err))
			unavailable = true
		default:
			errs[i] = fmt.Errorf("kafkaout: topic %q: %w", recs[i].Topic, pe.Err)
			unavailable = true
		}
	}
	if unavailable {
		p.reset()
		keepRefusedBatches(recs, errs)
	} else {
		p.resendRefusedBatches(ctx, recs, errs)
	}
	return errs
}

// keepRefusedBatches turns into ordinary errors the refusals of records
// refused for their batch (refusesTheBatch) when more than one was and the
// call failed too for a passing reason, so that they are not sent again
// one at a time now: none of them was refused alone, so none is charged;
// a later batch sends them again.
func keepRefusedBatches(recs []outbox.Record, errs []error) {
	var again []int
	for i, err := range errs {
		if refusesTheBatch(err) {
			again = append(again, i)
		}
	}
	if len(again) < 2 {
		return
	}
	for _, i := range again {
		errs[i] = fmt.Errorf("%w (with its batch; sent again later)", errors.Unwrap(errs[i]))
	}
}

// refusesTheBatch reports whether err is a refusal the broker gives a
// whole record batch for one of its records: too large (a topic whose
// max.message.bytes is below Producer.MaxMessageBytes refuses a batch of
// records it would take one by one), or a timestamp out of the topic's
// bounds (message.timestamp.before.max.ms, after.max.ms).
func refusesTheBatch(err error) bool {
	return errors.Is(err, sarama.ErrMessageSizeTooLarge) || errors.Is(err, sarama.ErrMessageSetSizeTooLarge) ||
		errors.Is(err, sarama.ErrInvalidTimestamp)
}

// resendRefusedBatches sends again, one at a time and in order, the
// records refused for their batch (refusesTheBatch) when more than one
// was: the broker refuses a whole batch for one record in it. A record
// refused alone is refused; the later records of its key are not sent (an
// ordinary error: the relay holds them behind it without charging them).
func (p *Publisher) resendRefusedBatches(ctx context.Context, recs []outbox.Record, errs []error) {
	var again []int
	for i, err := range errs {
		if refusesTheBatch(err) {
			again = append(again, i)
		}
	}
	if len(again) < 2 {
		return // a record refused alone was in a batch of its own
	}
	// A new producer: the refused batch may have left the old one's
	// sequence numbers ahead of what the broker took.
	p.reset()
	producer, err := p.connect(ctx)
	held := map[string]bool{}
	for _, i := range again {
		key := ""
		if recs[i].Key != nil {
			key = recs[i].Topic + "\x00" + string(recs[i].Key)
		}
		switch {
		case err != nil:
			errs[i] = err
			continue
		case key != "" && held[key]:
			errs[i] = fmt.Errorf("kafkaout: topic %q: held behind a refused record of its key", recs[i].Topic)
			continue
		case !p.current(producer):
			// Closed meanwhile (Close, from another goroutine): a send
			// on a closed sarama producer panics.
			errs[i] = fmt.Errorf("kafkaout: topic %q: %w", recs[i].Topic, errClosed)
			err = errs[i] // the rest are not sent
			continue
		}
		sendErr := p.sendOne(ctx, producer, p.message(recs[i]))
		switch {
		case sendErr == nil:
			errs[i] = nil
			continue
		case isRejection(sendErr):
			errs[i] = outbox.Rejected(fmt.Errorf("kafkaout: topic %q: %w", recs[i].Topic, sendErr))
		default:
			errs[i] = fmt.Errorf("kafkaout: topic %q: %w", recs[i].Topic, sendErr)
			p.reset()
			err = errs[i] // the rest are not sent
		}
		if key != "" {
			held[key] = true
		}
	}
}

// Check refuses a record with no topic, or one that does not fit, in a
// record batch of its own, in Producer.MaxMessageBytes, before it is sent.
func (p *Publisher) Check(rec outbox.Record) error {
	if rec.Topic == "" {
		return outbox.Rejected(errors.New("kafkaout: the message has no Topic"))
	}
	if size := p.message(rec).ByteSize(2) + recordBatchOverhead; size > p.sc.Producer.MaxMessageBytes {
		return outbox.Rejected(fmt.Errorf("kafkaout: message of %d bytes in its record batch is larger than Producer.MaxMessageBytes (%d)",
			size, p.sc.Producer.MaxMessageBytes))
	}
	return nil
}

// recordBatchOverhead is the header of a Kafka record batch (v2), which a
// broker counts with the records against max.message.bytes. sarama's own
// check leaves it out: a record at Producer.MaxMessageBytes passed it and
// was refused by a topic whose max.message.bytes is the same, alone, after
// the batch's later records of its key had been sent (they were confirmed
// ahead of it). With it counted, a record that passes Check fits a topic
// whose limit is at least Producer.MaxMessageBytes (sarama's ByteSize
// counts each varint of the record at its longest).
const recordBatchOverhead = 61

// message is the Kafka record of rec.
func (p *Publisher) message(rec outbox.Record) *sarama.ProducerMessage {
	m := &sarama.ProducerMessage{Topic: rec.Topic, Value: sarama.ByteEncoder(rec.Body), Timestamp: rec.CreatedAt}
	if rec.Key != nil {
		m.Key = sarama.ByteEncoder(rec.Key)
	}
	m.Headers = make([]sarama.RecordHeader, 0, len(rec.Headers)+2)
	for k, v := range rec.Headers {
		if k == p.cfg.IDHeader || k == p.cfg.TypeHeader {
			continue
		}
		m.Headers = append(m.Headers, sarama.RecordHeader{Key: []byte(k), Value: []byte(v)})
	}
	m.Headers = append(m.Headers, sarama.RecordHeader{Key: []byte(p.cfg.IDHeader), Value: []byte(rec.EventID)})
	if rec.Type != "" {
		m.Headers = append(m.Headers, sarama.RecordHeader{Key: []byte(p.cfg.TypeHeader), Value: []byte(rec.Type)})
	}
	return m
}

// isRejection reports whether err refuses the record itself: sending it
// again as it is fails again.
func isRejection(err error) bool {
	var ce sarama.ConfigurationError
	if errors.As(err, &ce) {
		return true
	}
	var ke sarama.KError
	if !errors.As(err, &ke) {
		return false
	}
	switch ke {
	case sarama.ErrUnknownTopicOrPartition, sarama.ErrInvalidTopic, sarama.ErrMessageSizeTooLarge,
		sarama.ErrMessageSetSizeTooLarge, sarama.ErrInvalidMessage, sarama.ErrTopicAuthorizationFailed,
		sarama.ErrPolicyViolation, sarama.ErrInvalidRecord, sarama.ErrUnsupportedForMessageFormat,
		// The record's timestamp (the row's created_at) is outside the
		// topic's bounds; a row only gets older.
		sarama.ErrInvalidTimestamp:
		return true
	}
	return false
}

// isRefusal reports whether err is the cluster refusing the producer
// itself, whatever it sends: a broker refusing the TLS or SASL settings,
// or the cluster authorisation (IDEMPOTENT_WRITE) the idempotent producer
// needs.
func isRefusal(err error) bool {
	var kr *kafkarefusal.Error
	return errors.As(err, &kr) || kafkarefusal.Classify("", err) != nil ||
		errors.Is(err, sarama.ErrClusterAuthorizationFailed)
}

// errClosed is the error of a call after Close.
var errClosed = errors.New("kafkaout: publisher closed")

// connect returns the producer, making one if there is none, or an error
// wrapping ctx's when ctx ends first. sarama's NewSyncProducer takes no
// context and waits out its own dial and metadata timeouts and retries, so
// it runs aside (dial): a call given up leaves it running, and the next
// call waits for the same connect, or takes the producer it made. Close
// ends it.
func (p *Publisher) connect(ctx context.Context) (sarama.SyncProducer, error) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, errClosed
	}
	if p.producer != nil {
		producer := p.producer
		p.mu.Unlock()
		return producer, nil
	}
	c := p.connecting
	if c == nil {
		c = &connecting{done: make(chan struct{}), dialer: newConnectDialer(p.sc)}
		c.ctx, c.cancel = context.WithCancel(context.Background())
		p.connecting = c
		go p.dial(c)
	}
	p.mu.Unlock()
	select {
	case <-c.done:
		return c.producer, c.err
	case <-ctx.Done():
		return nil, fmt.Errorf("kafkaout: connect: the publish's context ended before the cluster answered (the connect goes on for the next call): %w", context.Cause(ctx))
	}
}

// dial makes the producer of c and keeps it as the publisher's, or closes
// it when the publisher was closed meanwhile. Close ends it early, closing
// its connections (c.dialer) and cancelling its probe (c.ctx).
func (p *Publisher) dial(c *connecting) {
	defer c.cancel()
	sc := *p.sc
	sc.Net.Proxy.Enable = true
	sc.Net.Proxy.Dialer = c.dialer
	producer, err := sarama.NewSyncProducer(p.cfg.Brokers, &sc)
	c.dialer.seal()
	if err != nil && c.ctx.Err() == nil {
		// sarama reports a broker refusing the TLS or SASL settings as
		// no broker to talk to, without the broker's answer. The probe
		// is bounded by Config.Sarama's Net settings, as the connect,
		// and ends when the publisher is closed.
		err = fmt.Errorf("kafkaout: connect: %w", kafkarefusal.Explain(c.ctx, p.cfg.Brokers, p.sc, err))
		if isRefusal(err) {
			err = outbox.Refused(err)
		}
	} else if err != nil {
		err = fmt.Errorf("kafkaout: connect: %w (%w)", errClosed, err)
	}
	p.mu.Lock()
	p.connecting = nil
	if err == nil && p.closed {
		_ = producer.Close()
		producer, err = nil, errClosed
	}
	if err == nil {
		p.producer = producer
	}
	c.producer, c.err = producer, err
	p.mu.Unlock()
	close(c.done)
}

// errAbandoned wraps the context's error when Publish returned before the
// producer answered.
var errAbandoned = errors.New("kafkaout: the publish's context ended before the broker answered; the records may be sent all the same, and are sent again with their ids")

// send sends msgs with producer and returns its answer, or, when ctx ends
// first, an error wrapping ctx's: sarama's SyncProducer takes no context,
// and waits out its own request timeouts and retries (half a minute a try
// by default), which a relay's PublishTimeout may not allow. The producer
// is then given up (drop): its send goes on in the background, and it is
// closed once that returns; the next call makes a new one. The records of
// the call given up may still reach the broker, after the same records
// sent again by the next producer: copies with their ids, which consumers
// skip, and the first copy of each in the order of the batches.
func (p *Publisher) send(ctx context.Context, producer sarama.SyncProducer, msgs []*sarama.ProducerMessage) error {
	return p.bounded(ctx, producer, func() error { return producer.SendMessages(msgs) })
}

// bounded runs call, a send with producer, bounded by ctx: past it the
// producer is given up (drop) and the call goes on in the background.
// sarama feeds the producer on the caller's goroutine, where a producer
// that Close (from another goroutine) closed meanwhile panics: that is
// returned as an error wrapping errClosed.
func (p *Publisher) bounded(ctx context.Context, producer sarama.SyncProducer, call func() error) error {
	done := make(chan error, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		defer func() {
			if r := recover(); r != nil {
				done <- fmt.Errorf("%w: %v", errClosed, r)
			}
		}()
		done <- call()
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		p.drop(producer, finished)
		return fmt.Errorf("%w: %w", errAbandoned, context.Cause(ctx))
	}
}

// current reports whether producer is still the publisher's, not closed.
func (p *Publisher) current(producer sarama.SyncProducer) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return !p.closed && p.producer == producer
}

// sendOne sends msg alone with producer, bounded by ctx as send bounds a
// batch: sarama's SendMessage takes no context and waits out its own
// timeouts and retries.
func (p *Publisher) sendOne(ctx context.Context, producer sarama.SyncProducer, msg *sarama.ProducerMessage) error {
	return p.bounded(ctx, producer, func() error {
		_, _, err := producer.SendMessage(msg)
		return err
	})
}

// drop gives producer up while its send is in flight: the next call
// connects a new one, and producer is closed once the send returns
// (finished is closed). The send's answer does not matter: its records
// are sent again.
func (p *Publisher) drop(producer sarama.SyncProducer, finished <-chan struct{}) {
	p.mu.Lock()
	if p.producer == producer {
		p.producer = nil
	}
	p.mu.Unlock()
	go func() {
		<-finished
		_ = producer.Close()
	}()
}

// reset closes the producer after a failure: the next batch starts a new
// one, whose idempotence state (producer id, sequence numbers) is fresh.
func (p *Publisher) reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.producer != nil {
		_ = p.producer.Close()
		p.producer = nil
	}
}

// closeWait bounds how long Close waits for the producer to close.
const closeWait = 2 * time.Second

// Close closes the producer, waiting at most 2s: a sarama producer closes
// only once the requests in flight are answered, and a relay that stopped
// may have left one to a broker that does not answer (until
// Net.ReadTimeout). Past that Close returns an error and the producer
// finishes closing in the background. A connect in flight (one a Publish
// gave up) is ended at once: its connections are closed, and the producer
// it may still make is closed. Publish fails afterwards.
func (p *Publisher) Close() error {
	p.mu.Lock()
	p.closed = true
	producer := p.producer
	p.producer = nil
	if c := p.connecting; c != nil {
		// The connect in flight would go on for Config.Sarama's
		// timeouts and retries; its producer would be closed anyway.
		c.cancel()
		c.dialer.cutAll()
	}
	p.mu.Unlock()
	if producer == nil {
		return nil
	}
	done := make(chan error, 1)
	go func() { done <- producer.Close() }()
	t := time.NewTimer(closeWait)
	defer t.Stop()
	select {
	case err := <-done:
		return err
	case <-t.C:
		return fmt.Errorf("kafkaout: the producer did not close within %v (a request in flight that the broker does not answer); it goes on closing in the background", closeWait)
	}
}

func fill(n int, err error) []error {
	errs := make([]error, n)
	for i := range errs {
		errs[i] = err
	}
	return errs
}
