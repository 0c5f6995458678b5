package amqpout

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceco/once/internal/tlsfail"
	"github.com/onceco/once/internal/writeclock"
	"github.com/onceco/once/outbox"
)

// Defaults of Config fields left zero.
const (
	DefaultConfirmTimeout = 10 * time.Second
	DefaultDialTimeout    = 10 * time.Second
	DefaultHeartbeat      = 10 * time.Second
)

// Config configures a Publisher. URL is required.
type Config struct {
	// URL of the broker, "amqp://user:password@host:port/vhost" or
	// "amqps://...". Required.
	URL string
	// TLSConfig is used for amqps URLs. Nil: the system roots. Set with
	// an amqp:// URL, New refuses it (the connection would not use TLS).
	TLSConfig *tls.Config
	// DialTimeout bounds the TCP connect and the AMQP handshake, and the
	// opening of the publishing channel. Default 10s; at least a
	// millisecond (a unit mistake: 10 is 10 ns).
	DialTimeout time.Duration
	// Heartbeat is the AMQP heartbeat interval. Default 10s; at least 1s
	// (the protocol counts whole seconds). A heartbeat parameter in URL
	// takes its place (amqp091 reads it); heartbeat=0 is refused.
	Heartbeat time.Duration
	// ConnectionName is shown in the management UI. Default "once outbox".
	ConnectionName string
	// ConfirmTimeout bounds a write of a batch that makes no progress and
	// the wait for the broker's confirms once the batch is written, which
	// each confirm that comes starts again; past it the batch's
	// unconfirmed records are failed (and published again later), and the
	// connection is dropped: a broker under a memory or disk alarm stops
	// reading a connection that publishes, so neither a write larger than
	// the socket buffers nor a confirm ends until the alarm clears. A write
	// the broker is taking is not cut: a large batch on a slow link takes
	// what the link needs (within the relay's PublishTimeout). Default
	// 10s; at least a millisecond (a unit mistake: 10 is 10 ns).
	ConfirmTimeout time.Duration
	// Transient publishes with delivery mode 1 (not persisted by the
	// broker). Default false: persistent, which a durable queue needs to
	// keep the message across a broker restart.
	Transient bool
}

// Publisher publishes outbox records to RabbitMQ on a channel in confirm
// mode, each mandatory, a batch at a time: a record is confirmed when the
// broker acked it and did not return it as unroutable. It connects on
// first use and again after a failure. Use it from one goroutine (the
// relay's); Close may be called from any.
type Publisher struct {
	cfg Config

	mu      sync.Mutex
	conn    *amqp091.Connection
	ch      *amqp091.Channel
	returns chan amqp091.Return
	closes  chan *amqp091.Error
	closed  bool
	// closing is closed by Close before it takes mu, which a connect in
	// progress holds: the connect is given up at once (dial).
	closing   chan struct{}
	closeOnce sync.Once
	// wrote is when the connection last wrote to its socket (Unix
	// nanoseconds); a new one per connection.
	wrote *atomic.Int64
	// missing holds the exchanges a publish found missing: Check looks
	// them up before their next record is sent, because a publish to a
	// missing exchange closes the channel and fails the whole batch.
	missing map[string]bool
	// frameMax is the frame size negotiated with the broker on the last
	// connection (0: not connected yet): a message's properties and
	// headers travel in one content header frame, which cannot be split.
	frameMax int
	// maxBody is the broker's max_message_size, once a publish over it
	// closed a channel of this connection (0: not known): Check refuses a
	// larger record before it is sent, which would close the channel
	// again. A new connection forgets it (the setting is the node's).
	maxBody int
}

// New validates cfg and returns a Publisher; it does not connect yet.
func New(cfg Config) (*Publisher, error) {
	if cfg.URL == "" {
		return nil, errors.New("amqpout: Config.URL is required")
	}
	u, err := amqp091.ParseURI(cfg.URL)
	if err != nil {
		// Not the parser's error: it quotes the URL, password and all.
		return nil, errors.New("amqpout: Config.URL does not parse as amqp://user:password@host:port/vhost " +
			"(left out here: it may hold a password); percent-encode reserved characters in the user and password")
	}
	if cfg.TLSConfig != nil && u.Scheme != "amqps" {
		// amqp091 would ignore it and connect without TLS.
		return nil, errors.New("amqpout: Config.TLSConfig is set but Config.URL is not an amqps URL: the connection would not use TLS")
	}
	for _, d := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"ConfirmTimeout", &cfg.ConfirmTimeout, DefaultConfirmTimeout},
		{"DialTimeout", &cfg.DialTimeout, DefaultDialTimeout},
		{"Heartbeat", &cfg.Heartbeat, DefaultHeartbeat},
	} {
		if *d.v < 0 {
			return nil, fmt.Errorf("amqpout: Config.%s %v is negative", d.name, *d.v)
		}
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"DialTimeout", cfg.DialTimeout}, {"ConfirmTimeout", cfg.ConfirmTimeout}} {
		if d.v < time.Millisecond {
			// A unit mistake (ConfirmTimeout: 10 is 10 ns): every batch
			// would be given up before its confirms could come, and no
			// connect could finish; the relay would retry without end.
			return nil, fmt.Errorf("amqpout: Config.%s %v is below a millisecond (a time.Duration counts nanoseconds)", d.name, d.v)
		}
	}
	if cfg.Heartbeat < time.Second {
		// AMQP negotiates whole seconds; amqp091 takes less than one for
		// none and uses the broker's interval (60 s by default).
		return nil, fmt.Errorf("amqpout: Config.Heartbeat %v is below one second, the protocol's unit", cfg.Heartbeat)
	}
	if urlHeartbeatZero(cfg.URL) {
		// amqp091 takes the URL's heartbeat over Config.Heartbeat, and
		// proposes none for 0: the broker's interval would apply.
		return nil, errors.New("amqpout: Config.URL has heartbeat=0, which replaces Config.Heartbeat with the broker's interval (60 s by default); drop the parameter")
	}
	if cfg.ConnectionName == "" {
		cfg.ConnectionName = "once outbox"
	}
	return &Publisher{cfg: cfg, closing: make(chan struct{})}, nil
}

// urlHeartbeatZero reports whether the AMQP URL raw has the parameter
// heartbeat=0.
func urlHeartbeatZero(raw string) bool {
	u, err := url.Parse(raw)
	if err != nil || !u.Query().Has("heartbeat") {
		return false
	}
	hb, err := strconv.ParseUint(u.Query().Get("heartbeat"), 10, 16)
	return err == nil && hb == 0
}

// Publish publishes recs, in order, to exchange Topic with RoutingKey,
// mandatory, and waits for their confirms. A record returned unroutable
// (no queue bound), sent to an exchange that does not exist, is internal
// or that the user may not write to, with a routing key the user's topic
// permissions refuse, or larger than the broker's max_message_size gets
// an error wrapped with outbox.Rejected; a nack or a lost connection an
// ordinary error, after which the channel is replaced; a batch whose
// write the broker took nothing of for ConfirmTimeout, whose confirms
// stopped coming for ConfirmTimeout once it was written, or not confirmed
// before ctx is done (a broker under a resource alarm reads nothing more),
// an ordinary error too, after which the connection is replaced. A broker
// that stopped answering holds Publish at most DialTimeout twice (to
// connect, then to open the channel) plus ConfirmTimeout twice (for the
// write, then for the confirms), and never past the end of ctx or a Close;
// a broker taking the batch slowly (a large batch on a slow link) holds it
// as long as the link needs, up to the end of ctx. A broker
// that refuses the connection itself (the credentials, access to the
// vhost, the TLS handshake) gives every record an error wrapped with
// outbox.Refused: the relay retries, logging it as an error.
func (p *Publisher) Publish(ctx context.Context, recs []outbox.Record) []error {
	ch, returns, closes, wrote, err := p.channel(ctx)
	if err != nil {
		return fill(len(recs), err)
	}
	errs, confirms, err := p.send(ctx, ch, wrote, recs)
	if err != nil {
		return fill(len(recs), err)
	}
	// The confirms' wait starts once the batch is written: a large batch
	// on a slow link may take longer than ConfirmTimeout to write.
	cw := newConfirmWait(p.cfg.ConfirmTimeout)
	defer cw.stop()
	returned := map[returnKey]amqp091.Return{}
	for i, dc := range confirms {
		if dc != nil {
			errs[i] = p.await(ctx, cw, dc, returns, returned)
		}
	}
	// The broker sends a basic.return before the ack of the same message,
	// and the library hands both over in that order: every return of this
	// batch is in the channel by now.
	drainReturns(returns, returned)
	closeErr := closeError(closes)
	failed := p.classify(recs, errs, returned, closeErr)
	switch {
	case failed && (cw.expired || ctx.Err() != nil):
		// Confirms still missing at the deadline: the connection may be
		// one the broker no longer reads, where opening another channel
		// would wait as long.
		p.drop()
	case failed || closeErr != nil:
		p.reset()
	}
	if !failed && len(returned) == 0 && closeErr == nil {
		return nil
	}
	return errs
}

// send publishes recs without waiting; errs[i] is set for a record that
// could not be sent, confirms[i] for one that was. A broker under a
// resource alarm stops reading the connection, and amqp091 gives up no
// write on its context: the writes run aside, and when ctx ends before
// they do, or they make no progress (wrote, the connection's last write
// to its socket, stands still) for ConfirmTimeout, the connection is
// dropped (which ends the write) and err says that the batch could not be
// written. Writes that progress take the time the link needs (a full read
// of 16 MiB over 10 Mbit/s takes 13 s, more than the default
// ConfirmTimeout): bounding them by ConfirmTimeout would give the batch up
// on every attempt, and the relay would never get past it.
func (p *Publisher) send(ctx context.Context, ch *amqp091.Channel, wrote *atomic.Int64, recs []outbox.Record) (errs []error, confirms []*amqp091.DeferredConfirmation, err error) {
	type sent struct {
		errs     []error
		confirms []*amqp091.DeferredConfirmation
	}
	done := make(chan sent, 1)
	go func() {
		s := sent{make([]error, len(recs)), make([]*amqp091.DeferredConfirmation, len(recs))}
		for i, rec := range recs {
			dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, rec.Topic, rec.RoutingKey, true, false, p.publishing(rec))
			if err != nil {
				s.errs[i] = fmt.Errorf("amqpout: publish to exchange %q: %w", rec.Topic, err)
				continue
			}
			s.confirms[i] = dc
		}
		done <- s
	}()
	if s, ok := writeclock.Wait(ctx, done, wrote, p.cfg.ConfirmTimeout); ok {
		return s.errs, s.confirms, nil
	}
	select {
	case s := <-done:
		return s.errs, s.confirms, nil
	default:
	}
	p.drop()
	switch {
	case ctx.Err() == nil:
		return nil, nil, fmt.Errorf("amqpout: the broker took none of the batch for ConfirmTimeout %v (a broker under a resource alarm reads nothing); "+
			"its connection is dropped", p.cfg.ConfirmTimeout)
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		// The broker was taking the batch, but the link is too slow for
		// it within the publish's deadline (the relay's PublishTimeout).
		return nil, nil, fmt.Errorf("amqpout: the batch was not written whole by the publish's deadline (RelayConfig.PublishTimeout), "+
			"though the broker was taking it: a link this slow needs a longer PublishTimeout or a smaller BatchSize; its connection is dropped: %w", ctx.Err())
	}
	return nil, nil, fmt.Errorf("amqpout: the batch was not written whole when publishing stopped; its connection is dropped: %w", ctx.Err())
}

// classify turns returns and a missing exchange into rejections in errs,
// and reports whether any record failed otherwise.
func (p *Publisher) classify(recs []outbox.Record, errs []error, returned map[returnKey]amqp091.Return, closeErr *amqp091.Error) (failed bool) {
	missing := missingExchange(closeErr)
	refused := refusedPublish(closeErr)
	limit := maxMessageSize(closeErr)
	if limit > 0 {
		p.mu.Lock()
		p.maxBody = limit
		p.mu.Unlock()
	}
	for i, rec := range recs {
		switch r, wasReturned := returned[returnKey{rec.Topic, rec.RoutingKey, rec.EventID}]; {
		case errs[i] == nil && wasReturned:
			errs[i] = outbox.Rejected(fmt.Errorf("amqpout: exchange %q routing key %q: unroutable: %d %s",
				rec.Topic, rec.RoutingKey, r.ReplyCode, r.ReplyText))
		case errs[i] == nil:
		case missing != "" && missing == rec.Topic:
			p.markMissing(missing)
			errs[i] = outbox.Rejected(fmt.Errorf("amqpout: exchange %q does not exist: %w", rec.Topic, closeErr))
		case refused.refuses(rec):
			errs[i] = outbox.Rejected(fmt.Errorf("amqpout: exchange %q refuses the publish: %w", rec.Topic, closeErr))
		case limit > 0 && len(rec.Body) > limit:
			errs[i] = outbox.Rejected(fmt.Errorf("amqpout: message of %d bytes is larger than the broker's max size: %w", len(rec.Body), closeErr))
		default:
			if closeErr != nil {
				errs[i] = fmt.Errorf("%w (channel closed: %w)", errs[i], closeErr)
			}
			failed = true
		}
	}
	return failed
}

// Check refuses a record that AMQP cannot carry (an exchange, routing
// key, event id, type or header name over 255 bytes, a header named "CC"
// or "BCC", which RabbitMQ routes by and refuses as a string, properties and
// headers that do not fit in one frame of the connection's frame_max, 128
// KiB by default), a record larger
// than the broker's max_message_size, once a publish found that limit,
// and a record to an exchange that a publish found missing and that a
// passive declare (on a channel of its own) still does not find; records
// to other exchanges pass unchecked. A lookup the broker does not answer
// within ConfirmTimeout keeps the record for a later batch (an error not
// wrapped with outbox.Rejected) and drops the connection: until the next
// publish connects again, records pass unchecked.
func (p *Publisher) Check(rec outbox.Record) error {
	if err := checkShortStrings(rec); err != nil {
		return outbox.Rejected(err)
	}
	if err := checkRoutingHeaders(rec); err != nil {
		return outbox.Rejected(err)
	}
	p.mu.Lock()
	missing, conn, maxBody, frameMax := p.missing[rec.Topic], p.conn, p.maxBody, p.frameMax
	p.mu.Unlock()
	if frameMax <= 0 {
		// Not connected yet: the frame size will be at most what amqp091
		// proposes.
		frameMax = defaultFrameMax
	}
	if size := p.headerFrameSize(rec); size > frameMax-frameOverhead {
		return outbox.Rejected(fmt.Errorf("amqpout: the message's properties and headers take %d bytes, more than one frame carries "+
			"(frame_max %d, AMQP cannot split them)", size, frameMax))
	}
	if maxBody > 0 && len(rec.Body) > maxBody {
		return outbox.Rejected(fmt.Errorf("amqpout: message of %d bytes is larger than the broker's max size %d (max_message_size)",
			len(rec.Body), maxBody))
	}
	if !missing || conn == nil {
		return nil
	}
	// The lookup's calls wait for the broker without a bound of their own:
	// one that stopped answering (its connection held, not closed) would
	// hold the relay, which calls Check before it publishes, until the
	// broker drops the connection. Past ConfirmTimeout the record is kept
	// for a later batch, neither sent nor charged.
	found := make(chan error, 1)
	go func() { found <- lookUpExchange(conn, rec.Topic) }()
	var err error
	select {
	case err = <-found:
	case <-time.After(p.cfg.ConfirmTimeout):
		// The connection is dropped: the records after this one are not
		// looked up on it, each waiting another ConfirmTimeout (they pass
		// unchecked, and the next publish connects again).
		p.dropIf(conn)
		return fmt.Errorf("amqpout: no answer within ConfirmTimeout %v to the lookup of exchange %q", p.cfg.ConfirmTimeout, rec.Topic)
	}
	var ae *amqp091.Error
	if errors.As(err, &ae) && ae.Code == amqp091.NotFound {
		return outbox.Rejected(fmt.Errorf("amqpout: exchange %q does not exist: %w", rec.Topic, err))
	}
	if err == nil {
		p.mu.Lock()
		delete(p.missing, rec.Topic)
		p.mu.Unlock()
	}
	return nil // any other failure: Publish meets it too and reports it
}

// lookUpExchange declares exchange passively on a channel of its own: an
// amqp091.Error with code NotFound when it does not exist.
func lookUpExchange(conn *amqp091.Connection, exchange string) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	err = ch.ExchangeDeclarePassive(exchange, "direct", true, false, false, false, nil)
	if err == nil {
		_ = ch.Close()
	}
	return err
}

// defaultFrameMax is the frame size amqp091 proposes (RabbitMQ's default
// frame_max); the negotiated one is at most that.
const defaultFrameMax = 131072

// frameOverhead is what a frame adds to its payload: type, channel and
// size before it, the end octet after.
const frameOverhead = 8

// headerFrameSize is the size of the payload of the content header frame
// that carries rec's properties (as publishing sets them) and headers, as
// amqp091 writes it: class id, weight, body size and property flags, then
// each property set; the headers a field table of long strings.
func (p *Publisher) headerFrameSize(rec outbox.Record) int {
	n := 2 + 2 + 8 + 2
	for _, s := range [...]string{rec.EventID, rec.Type} {
		if s != "" {
			n += 1 + len(s)
		}
	}
	table, fields := 4, 0
	for k, v := range rec.Headers {
		if k == "id" || k == "type" {
			continue
		}
		table += 1 + len(k) + 1 + 4 + len(v)
		fields++
	}
	if fields > 0 {
		n += table
	}
	n++ // delivery mode
	if !rec.CreatedAt.IsZero() {
		n += 8
	}
	return n
}

// maxShortString is the longest AMQP short string, in bytes: exchange
// names, routing keys, the message-id and type properties, table keys.
const maxShortString = 255

// checkShortStrings reports a field of rec too long for an AMQP short
// string: amqp091 fails such a publish, or sends half of it, which closes
// the connection.
func checkShortStrings(rec outbox.Record) error {
	for _, f := range []struct{ name, v string }{
		{"exchange (Topic)", rec.Topic}, {"routing key", rec.RoutingKey}, {"event id (message-id)", rec.EventID}, {"type", rec.Type},
	} {
		if len(f.v) > maxShortString {
			return fmt.Errorf("amqpout: the %s is %d bytes long; AMQP carries at most %d bytes", f.name, len(f.v), maxShortString)
		}
	}
	for k := range rec.Headers {
		if len(k) > maxShortString {
			return fmt.Errorf("amqpout: a header name is %d bytes long; AMQP carries at most %d bytes", len(k), maxShortString)
		}
	}
	return nil
}

// routingHeaders are the headers RabbitMQ routes a message by besides its
// routing key (sender-selected distribution): each must be an array of
// strings, and a message where one is anything else closes the channel
// (406 PRECONDITION_FAILED, unacceptable_type_in_header). Names are
// case-sensitive.
var routingHeaders = [...]string{"CC", "BCC"}

// checkRoutingHeaders reports a header of rec that RabbitMQ refuses: a
// routing header, which an outbox header, a string, cannot be. Sent, it
// would close the channel at every attempt, failing its batch from it on
// without being charged.
func checkRoutingHeaders(rec outbox.Record) error {
	for _, name := range routingHeaders {
		if _, ok := rec.Headers[name]; ok {
			return fmt.Errorf("amqpout: header %q is a RabbitMQ routing header (sender-selected distribution), "+
				"which must be an array of routing keys, and an outbox header is a string; rename it", name)
		}
	}
	return nil
}

func (p *Publisher) markMissing(exchange string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.missing == nil {
		p.missing = map[string]bool{}
	}
	p.missing[exchange] = true
}

// confirmWait bounds the wait for a written batch's confirms: it expires
// once no confirm came for the timeout. On a slow link the batch's last
// records are still on their way when its write ends (in the sockets'
// buffers), and their confirms come one after another as they arrive.
type confirmWait struct {
	timeout time.Duration
	timer   *time.Timer
	expired bool
}

func newConfirmWait(timeout time.Duration) *confirmWait {
	return &confirmWait{timeout: timeout, timer: time.NewTimer(timeout)}
}

// confirmed starts the wait again: a confirm came.
func (w *confirmWait) confirmed() {
	if !w.expired {
		w.timer.Reset(w.timeout)
	}
}

// stop releases the wait's timer.
func (w *confirmWait) stop() { w.timer.Stop() }

// await waits for dc's confirm, collecting returns meanwhile so that the
// library never blocks handing one over. Once cw has expired it takes a
// confirm already there and waits for none.
func (p *Publisher) await(ctx context.Context, cw *confirmWait, dc *amqp091.DeferredConfirmation, returns <-chan amqp091.Return, returned map[returnKey]amqp091.Return) error {
	if cw.expired {
		select {
		case <-dc.Done():
			return confirmResult(dc)
		default:
			return p.noConfirm()
		}
	}
	for {
		select {
		case <-dc.Done():
			cw.confirmed()
			return confirmResult(dc)
		case r, ok := <-returns:
			if !ok { // the channel closed: its confirms are resolved (nacked)
				returns = nil
				continue
			}
			returned[keyOf(r)] = r
		case <-ctx.Done():
			return fmt.Errorf("amqpout: no publisher confirm when publishing stopped: %w", ctx.Err())
		case <-cw.timer.C:
			cw.expired = true
			return p.noConfirm()
		}
	}
}

// confirmResult is the outcome of dc, which is done.
func confirmResult(dc *amqp091.DeferredConfirmation) error {
	if !dc.Acked() {
		return errors.New("amqpout: the broker nacked the message (or the channel closed before its confirm)")
	}
	return nil
}

// noConfirm is the error of a record whose confirm had not come when the
// batch's confirms stopped coming for ConfirmTimeout.
func (p *Publisher) noConfirm() error {
	return fmt.Errorf("amqpout: no publisher confirm for ConfirmTimeout %v once the batch was written", p.cfg.ConfirmTimeout)
}

// returnKey tells which records of a batch a basic.return is about: the
// message id alone does not, since rows written under one id (an event
// published to two exchanges) may go to different destinations, of which
// only one is unroutable. Records alike in all three are routed alike.
type returnKey struct{ exchange, routingKey, messageID string }

func keyOf(r amqp091.Return) returnKey { return returnKey{r.Exchange, r.RoutingKey, r.MessageId} }

// drainReturns moves the returns waiting in the channel into returned.
func drainReturns(returns <-chan amqp091.Return, returned map[returnKey]amqp091.Return) {
	for {
		select {
		case r, ok := <-returns:
			if !ok {
				return
			}
			returned[keyOf(r)] = r
		default:
			return
		}
	}
}

// closeError is the channel's close reason if it closed.
func closeError(closes <-chan *amqp091.Error) *amqp091.Error {
	select {
	case e := <-closes:
		return e
	default:
		return nil
	}
}

var noExchange = regexp.MustCompile(`no exchange '(.*)' in vhost`)

// missingExchange names the exchange a 404 channel close complains of.
func missingExchange(e *amqp091.Error) string {
	if e == nil || e.Code != amqp091.NotFound {
		return ""
	}
	if m := noExchange.FindStringSubmatch(e.Reason); m != nil {
		return m[1]
	}
	return ""
}

var (
	accessRefused = regexp.MustCompile(`exchange '(.*)' in vhost`)
	topicRefused  = regexp.MustCompile(`access to topic '(.*)' in exchange '(.*)' in vhost`)
)

// refusal is what a 403 channel close says cannot be published: every
// message to exchange (the user may not write to it, or it is internal),
// or, under RabbitMQ's topic permissions, which allow or refuse routing
// keys, only those with routingKey.
type refusal struct {
	exchange, routingKey string
	byRoutingKey         bool
}

// refuses reports whether r refuses rec.
func (r *refusal) refuses(rec outbox.Record) bool {
	return r != nil && r.exchange == rec.Topic && (!r.byRoutingKey || r.routingKey == rec.RoutingKey)
}

// refusedPublish reads what a 403 channel close refuses; nil for any other
// close. A routing key the topic permissions refuse is not its exchange
// refused: the batch's other records to it failed only because the channel
// closed, and are sent again, not charged.
func refusedPublish(e *amqp091.Error) *refusal {
	if e == nil || e.Code != amqp091.AccessRefused {
		return nil
	}
	if m := topicRefused.FindStringSubmatch(e.Reason); m != nil {
		return &refusal{exchange: m[2], routingKey: m[1], byRoutingKey: true}
	}
	if m := accessRefused.FindStringSubmatch(e.Reason); m != nil {
		return &refusal{exchange: m[1]}
	}
	return nil
}

var tooLarge = regexp.MustCompile(`message size \d+ is larger than configured max size (\d+)`)

// maxMessageSize is the max_message_size a 406 channel close reports when
// a message exceeded it; 0 for any other close.
func maxMessageSize(e *amqp091.Error) int {
	if e == nil || e.Code != amqp091.PreconditionFailed {
		return 0
	}
	if m := tooLarge.FindStringSubmatch(e.Reason); m != nil {
		if n, err := strconv.Atoi(m[1]); err == nil {
			return n
		}
	}
	return 0
}

// publishing is the AMQP message of rec.
func (p *Publisher) publishing(rec outbox.Record) amqp091.Publishing {
	headers := make(amqp091.Table, len(rec.Headers))
	for k, v := range rec.Headers {
		// The id and the type are the message-id and type properties;
		// headers of those names would carry a second id or a type the
		// message does not have (outbox.Message.Headers).
		if k == "id" || k == "type" {
			continue
		}
		headers[k] = v
	}
	mode := amqp091.Persistent
	if p.cfg.Transient {
		mode = amqp091.Transient
	}
	return amqp091.Publishing{
		Headers:      headers,
		DeliveryMode: mode,
		MessageId:    rec.EventID,
		Type:         rec.Type,
		Timestamp:    rec.CreatedAt,
		Body:         rec.Body,
	}
}

// channel returns the confirm-mode channel, and when its connection last
// wrote to its socket, connecting if needed.
func (p *Publisher) channel(ctx context.Context) (*amqp091.Channel, chan amqp091.Return, chan *amqp091.Error, *atomic.Int64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, nil, nil, nil, errors.New("amqpout: publisher closed")
	}
	if p.ch != nil && !p.ch.IsClosed() {
		return p.ch, p.returns, p.closes, p.wrote, nil
	}
	if p.conn == nil || p.conn.IsClosed() {
		wrote := new(atomic.Int64)
		conn, err := p.dial(ctx, wrote)
		if err != nil {
			err = fmt.Errorf("amqpout: connect: %w", redact(err))
			if refusesConnection(err) {
				err = outbox.Refused(err)
			}
			return nil, nil, nil, nil, err
		}
		p.conn, p.wrote = conn, wrote
		p.maxBody = 0
		p.frameMax = conn.Config.FrameSize
	}
	ch, err := openConfirmChannel(ctx, p.closing, p.conn, p.cfg.DialTimeout)
	if err != nil {
		if errors.Is(err, errNoAnswer) {
			p.dropLocked()
		}
		return nil, nil, nil, nil, err
	}
	// Buffered so that the library's reader never waits for us between
	// batches; while a batch is confirmed, await reads it.
	p.returns = ch.NotifyReturn(make(chan amqp091.Return, 1024))
	p.closes = ch.NotifyClose(make(chan *amqp091.Error, 1))
	p.ch = ch
	return p.ch, p.returns, p.closes, p.wrote, nil
}

// errGivenUp is dial's error when the connect was given up.
var errGivenUp = errors.New("connect given up")

// dial connects to the broker aside and waits for the connection until ctx
// is done or Close is called (errGivenUp): amqp091 takes no context, and a
// broker that accepts the connection and then says nothing (frozen, or a
// network holding the traffic) holds the connect for DialTimeout, with
// the publisher's lock, which Close takes. A connection made after it was
// given up is closed. The connection records its writes in wrote.
func (p *Publisher) dial(ctx context.Context, wrote *atomic.Int64) (*amqp091.Connection, error) {
	type dialed struct {
		conn *amqp091.Connection
		err  error
	}
	done := make(chan dialed, 1)
	go func() {
		conn, err := amqp091.DialConfig(p.cfg.URL, amqp091.Config{
			Heartbeat: p.cfg.Heartbeat,
			// A copy: amqp091 writes the URL's host into an empty
			// ServerName of the config it is given.
			TLSClientConfig: p.cfg.TLSConfig.Clone(),
			Properties:      amqp091.Table{"connection_name": p.cfg.ConnectionName},
			Dial:            writeclock.Dial(amqp091.DefaultDial(p.cfg.DialTimeout), wrote),
		})
		done <- dialed{conn, err}
	}()
	var why error
	select {
	case d := <-done:
		return d.conn, d.err
	case <-ctx.Done():
		why = ctx.Err()
	case <-p.closing:
		why = errors.New("publisher closed")
	}
	go func() {
		if d := <-done; d.conn != nil {
			_ = d.conn.CloseDeadline(time.Now().Add(closeWait))
		}
	}()
	return nil, fmt.Errorf("%w: %w", errGivenUp, why)
}

// refusesConnection reports whether a dial's err is the broker refusing
// the publisher's configuration, which it refuses again on every attempt
// until one side changes: the credentials, the SASL mechanism, access to
// the vhost, the TLS handshake (a certificate not trusted or not
// presented, an amqps URL at a port that speaks plain AMQP). A connection
// limit reached is not among them: connections that close free it.
func refusesConnection(err error) bool {
	if tlsfail.Refused(err) {
		return true
	}
	if errors.Is(err, amqp091.ErrSASL) || errors.Is(err, amqp091.ErrCredentials) || errors.Is(err, amqp091.ErrVhost) {
		return true
	}
	var ae *amqp091.Error
	if !errors.As(err, &ae) {
		return false
	}
	switch {
	case !ae.Server && ae.Code == amqp091.FrameError && strings.HasPrefix(ae.Reason, "remote error: tls: "):
		// An alert the broker sent once the handshake was over (TLS 1.3
		// refuses a missing client certificate so).
		return true
	case ae.Code == amqp091.AccessRefused:
		return true
	case ae.Code == amqp091.NotAllowed:
		return !strings.Contains(ae.Reason, "connection limit")
	}
	return false
}

// redact drops a URL (and its password) from a dial error.
func redact(err error) error {
	var ne *net.OpError
	if errors.As(err, &ne) {
		return ne
	}
	return err
}

// errNoAnswer is openConfirmChannel's error when the broker did not answer
// in time.
var errNoAnswer = errors.New("no answer from the broker")

// openConfirmChannel opens a channel on conn and puts it in confirm mode.
// The broker answers neither while it blocks the connection (a resource
// alarm), and amqp091 waits for the answers without a bound: they are
// waited for aside, at most timeout or until ctx is done or closing is
// closed (errNoAnswer; the caller drops conn, which ends them).
func openConfirmChannel(ctx context.Context, closing <-chan struct{}, conn *amqp091.Connection, timeout time.Duration) (*amqp091.Channel, error) {
	type opened struct {
		ch  *amqp091.Channel
		err error
	}
	done := make(chan opened, 1)
	go func() {
		ch, err := conn.Channel()
		if err != nil {
			done <- opened{nil, fmt.Errorf("amqpout: open channel: %w", err)}
			return
		}
		if err := ch.Confirm(false); err != nil {
			_ = ch.Close()
			done <- opened{nil, fmt.Errorf("amqpout: confirm mode: %w", err)}
			return
		}
		done <- opened{ch, nil}
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case o := <-done:
		return o.ch, o.err
	case <-t.C:
		return nil, fmt.Errorf("amqpout: open channel: %w within DialTimeout %v", errNoAnswer, timeout)
	case <-ctx.Done():
		return nil, fmt.Errorf("amqpout: open channel: %w: %w", errNoAnswer, ctx.Err())
	case <-closing:
		return nil, fmt.Errorf("amqpout: open channel: %w: publisher closed", errNoAnswer)
	}
}

// closeWait bounds how long closing a connection waits for the broker's
// answer: one under a resource alarm never answers.
const closeWait = 2 * time.Second

// drop abandons the connection after a batch it could not write or get
// confirmed in time, without waiting for the broker; the next batch
// connects again.
func (p *Publisher) drop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dropLocked()
}

// dropIf drops the connection if it is still conn.
func (p *Publisher) dropIf(conn *amqp091.Connection) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conn == conn {
		p.dropLocked()
	}
}

func (p *Publisher) dropLocked() {
	if p.conn != nil {
		// The deadline closing sets on the socket also ends a write the
		// broker does not read.
		go func(conn *amqp091.Connection) { _ = conn.CloseDeadline(time.Now().Add(closeWait)) }(p.conn)
	}
	p.conn, p.ch = nil, nil
}

// reset drops the channel after a failure; the next batch opens a new one
// (and reconnects if the connection is gone too). Closing waits for the
// broker, which may be what is stuck: it is not waited for.
func (p *Publisher) reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ch != nil {
		go func(ch *amqp091.Channel) { _ = ch.Close() }(p.ch)
		p.ch = nil
	}
}

// Close closes the connection, waiting at most 2s for the broker's answer
// (a broker under a resource alarm gives none); a connect in progress is
// given up. Publish fails afterwards.
func (p *Publisher) Close() error {
	p.closeOnce.Do(func() { close(p.closing) })
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	if p.conn == nil {
		return nil
	}
	err := p.conn.CloseDeadline(time.Now().Add(closeWait))
	p.conn, p.ch = nil, nil
	return err
}

func fill(n int, err error) []error {
	errs := make([]error, n)
	for i := range errs {
		errs[i] = err
	}
	return errs
}
