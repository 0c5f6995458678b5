package amqp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/writeclock"
)

// ErrPublisherBlocked is wrapped by Delivery.DeadLetter's error while the
// broker blocks the dead-letter connection (a memory or disk alarm):
// nothing is published, and the consumer retries after its backoff. The
// consuming connection is not affected and keeps acking.
var ErrPublisherBlocked = errors.New("amqp: the broker blocks the dead-letter connection (resource alarm)")

// publisher publishes dead-letter copies on a connection of its own, in
// confirm mode. RabbitMQ blocks a connection that publishes under a memory
// or disk alarm, and a blocked connection carries no frame at all: on the
// consuming connection, one dead letter would stall every ack behind it.
// The connection is dialled on first use and again after it is lost, on
// the next publish, independently of the consuming connection; a channel
// the broker closed over a refused copy is opened again on the same
// connection.
type publisher struct {
	cfg *Config
	log *slog.Logger

	mu      sync.Mutex // serialises publishes: a basic.return belongs to the publish in progress
	conn    *amqp091.Connection
	ch      *amqp091.Channel
	returns chan amqp091.Return
	// chClosed gets the broker's reason when it closes ch (a publish to
	// a missing exchange).
	chClosed chan *amqp091.Error
	// redeclare: a copy found the dead-letter destination missing (its
	// queue or exchange deleted since Open declared it); the next attempt
	// declares it again before publishing, on a new channel of the
	// connection, or on a new connection when the broker blocks it.
	redeclare bool
	blocked   *blockState
	// wrote is when the connection last wrote to its socket (Unix
	// nanoseconds); a new one per connection.
	wrote *atomic.Int64
	// pending is a publish left unconfirmed when the broker blocked the
	// connection: its confirm (and return) comes once the alarm clears,
	// and must come before the next publish, whose return could otherwise
	// be taken for it.
	pending    *amqp091.DeferredConfirmation
	pendingFor any // the id of the pending publish
	// confirmedFor is the id of the last pending publish whose confirm
	// came while another id was publishing: its own retry takes it, as
	// confirmedErr, instead of publishing a second copy.
	confirmedFor any
	confirmedErr error
	closed       bool
	// closing is closed when close begins, before it takes mu: a copy's
	// write, which a slow link may make long, ends then.
	closing   chan struct{}
	closeOnce sync.Once
}

// blockState is what the connection.blocked notifications of one
// connection last said; changed gets a signal at each notification.
type blockState struct {
	mu      sync.Mutex
	reason  string // "" when not blocked
	changed chan struct{}
}

func newBlockState() *blockState { return &blockState{changed: make(chan struct{}, 1)} }

func (b *blockState) set(n amqp091.Blocking) {
	b.mu.Lock()
	b.reason = ""
	if n.Active {
		b.reason = n.Reason
		if b.reason == "" {
			b.reason = "no reason given"
		}
	}
	b.mu.Unlock()
	select {
	case b.changed <- struct{}{}:
	default:
	}
}

func (b *blockState) get() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.reason
}

func newPublisher(cfg *Config, log *slog.Logger) *publisher {
	return &publisher{cfg: cfg, log: log, blocked: newBlockState(), closing: make(chan struct{})}
}

// publish publishes the message build returns for the connection's frame
// size (0: no limit), mandatory, to exchange with key and waits for the
// broker's confirm, at most timeout. While the broker blocks the
// connection it fails at once with ErrPublisherBlocked, keeping the
// connection and the unconfirmed publish for when the alarm clears; a
// retry with the same id (the delivery being dead-lettered) then takes
// that publish's confirm instead of publishing another copy.
func (p *publisher) publish(ctx context.Context, id any, exchange, key string, build func(frameMax int) amqp091.Publishing, timeout time.Duration) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.ready(ctx); err != nil {
		return err
	}
	if done, err := p.takeConfirmed(id); done {
		return err
	}
	if done, err := p.settlePending(ctx, id, timeout); done || err != nil {
		return err
	}
	p.drainReturns()
	msg := build(p.conn.Config.FrameSize)
	dc, err := p.send(ctx, exchange, key, msg, timeout)
	if err != nil {
		p.drop()
		return fmt.Errorf("amqp: publish to exchange %q with key %q: %w", exchange, key, err)
	}
	// The confirm's wait starts once the copy is written: a large copy
	// on a slow link may take longer than timeout to write.
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := p.waitConfirm(wctx, ctx, id, dc, timeout); err != nil {
		return fmt.Errorf("amqp: publish to exchange %q with key %q: %w", exchange, key, err)
	}
	return p.returned()
}

// send writes msg, mandatory, and returns its deferred confirmation. A
// broker under a resource alarm stops reading a connection once it
// publishes, so the write of a copy larger than the sockets' buffers does
// not end until the alarm clears, and amqp091 gives up no write on its
// context. A write that makes no progress for timeout (the socket took no
// byte) is given up and the connection dropped: the deadline dropping
// sets on its socket ends the write, and the broker discards the partial
// copy. A write that progresses takes the time the link needs (a 100 MB
// body over a 50 Mbit/s link takes 16 s, more than the default
// ConfirmTimeout): bounding it by timeout would give it up on every
// attempt, and the message would never be dead-lettered.
func (p *publisher) send(ctx context.Context, exchange, key string, msg amqp091.Publishing, timeout time.Duration) (*amqp091.DeferredConfirmation, error) {
	type written struct {
		dc  *amqp091.DeferredConfirmation
		err error
	}
	ch, wrote := p.ch, p.wrote
	done := make(chan written, 1)
	go func() {
		dc, err := ch.PublishWithDeferredConfirm(exchange, key, true, false, msg)
		done <- written{dc, err}
	}()
	// The write also ends when close begins, which takes mu after it.
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-p.closing:
			cancel()
		case <-wctx.Done():
		}
	}()
	if w, ok := writeclock.Wait(wctx, done, wrote, timeout); ok {
		return w.dc, w.err
	}
	select {
	case w := <-done:
		return w.dc, w.err
	default:
	}
	reason := p.blocked.get()
	p.drop()
	switch {
	case ctx.Err() != nil:
		return nil, fmt.Errorf("write the copy: %w", ctx.Err())
	case p.isClosing():
		return nil, fmt.Errorf("write the copy: the source is closing: %w", ErrChannelClosed)
	case reason != "":
		return nil, fmt.Errorf("%w: %s (the copy could not be written whole; its connection is dropped)", ErrPublisherBlocked, reason)
	default:
		return nil, fmt.Errorf("the broker took none of the copy for Config.ConfirmTimeout %v; its connection is dropped", timeout)
	}
}

// isClosing reports whether close has begun.
func (p *publisher) isClosing() bool {
	select {
	case <-p.closing:
		return true
	default:
		return false
	}
}

// closeReason returns the broker's reason for closing the dead-letter
// channel, if it did (amqp091 hands it over before it fails the
// channel's unconfirmed publishes), and notes a missing exchange for
// redeclaring.
func (p *publisher) closeReason() *amqp091.Error {
	select {
	case e, ok := <-p.chClosed:
		if !ok || e == nil {
			return nil
		}
		if e.Code == amqp091.NotFound {
			p.redeclare = true
		}
		return e
	default:
		return nil
	}
}

// returned reports the return of the publish just confirmed, if any: the
// broker sends it before the confirm, and the connection's reader hands it
// over before it handles the confirm. amqp091 closes the returns channel
// with the channel; a return handed over before stays readable, so a
// closed one means there was none.
func (p *publisher) returned() error {
	select {
	case r, ok := <-p.returns:
		if !ok {
			return nil
		}
		if r.ReplyCode == amqp091.NoRoute && p.cfg.DeadLetter.Queue != "" {
			// The dead-letter queue, or its binding, is gone.
			p.redeclare = true
		}
		return fmt.Errorf("amqp: publish to exchange %q with key %q was unroutable: %d %s: %w", r.Exchange, r.RoutingKey, r.ReplyCode, r.ReplyText, errUnroutable)
	default:
		return nil
	}
}

// settlePending deals with a publish left unconfirmed by an alarm, before
// the publish for id: while the broker still blocks the connection, it
// fails with ErrPublisherBlocked; once unblocked, it waits for the
// confirm, at most timeout (then the connection is stuck, and dropped).
// When the pending publish was id's own, done reports it, and err is its
// outcome; otherwise the next publish may go.
func (p *publisher) settlePending(ctx context.Context, id any, timeout time.Duration) (done bool, err error) {
	if p.pending == nil {
		if reason := p.blocked.get(); reason != "" {
			return false, fmt.Errorf("%w: %s", ErrPublisherBlocked, reason)
		}
		return false, nil
	}
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		select {
		case <-p.pending.Done():
			return p.pendingConfirmed(id)
		default:
		}
		if reason := p.blocked.get(); reason != "" {
			return false, fmt.Errorf("%w: %s", ErrPublisherBlocked, reason)
		}
		select {
		case <-p.pending.Done():
		case <-p.blocked.changed:
		case <-wctx.Done():
			p.drop()
			if err := ctx.Err(); err != nil {
				return false, fmt.Errorf("amqp: wait for publisher confirm: %w", err)
			}
			return false, p.ready(ctx)
		}
	}
}

// pendingConfirmed clears the pending publish, whose confirm came, and
// reports its outcome when it was id's; another id's outcome is kept for
// that id's retry.
func (p *publisher) pendingConfirmed(id any) (done bool, err error) {
	dc, owner := p.pending, p.pendingFor
	p.pending, p.pendingFor = nil, nil
	err = p.returned()
	if !dc.Acked() {
		// Its channel's close (the connection lost during the alarm)
		// fails it as well, and is no queue's refusal.
		if e := p.closeReason(); e != nil {
			err = fmt.Errorf("amqp: the dead-letter copy: the dead-letter channel closed: %w", e)
		} else {
			err = fmt.Errorf("amqp: the dead-letter copy: %w", errNacked)
		}
	}
	if owner != id {
		p.confirmedFor, p.confirmedErr = owner, err
		return false, nil
	}
	return true, err
}

// takeConfirmed reports the outcome of id's publish that was confirmed
// while another id was publishing, if there is one.
func (p *publisher) takeConfirmed(id any) (done bool, err error) {
	if p.confirmedFor == nil || p.confirmedFor != id {
		return false, nil
	}
	err = p.confirmedErr
	p.confirmedFor, p.confirmedErr = nil, nil
	return true, err
}

// waitConfirm waits for dc's confirm. When the broker blocks the
// connection meanwhile, it returns ErrPublisherBlocked at once and keeps
// dc pending; when no confirm comes within timeout, it drops the
// connection, so that a late confirm or return cannot be taken for the
// next publish's.
func (p *publisher) waitConfirm(wctx, ctx context.Context, id any, dc *amqp091.DeferredConfirmation, timeout time.Duration) error {
	for {
		select {
		case <-dc.Done():
			if !dc.Acked() {
				if e := p.closeReason(); e != nil {
					return fmt.Errorf("the dead-letter channel closed: %w", e)
				}
				return errNacked
			}
			return nil
		case <-p.blocked.changed:
			if reason := p.blocked.get(); reason != "" {
				p.pending, p.pendingFor = dc, id
				return fmt.Errorf("%w: %s", ErrPublisherBlocked, reason)
			}
		case <-wctx.Done():
			reason := p.blocked.get()
			if reason != "" {
				p.pending, p.pendingFor = dc, id
				return fmt.Errorf("%w: %s", ErrPublisherBlocked, reason)
			}
			p.drop()
			if ctx.Err() == nil {
				return fmt.Errorf("no publisher confirm within Config.ConfirmTimeout %v", timeout)
			}
			return fmt.Errorf("wait for publisher confirm: %w", ctx.Err())
		}
	}
}

// ready makes sure a connection and a confirm-mode channel are open,
// dialling once if not: the caller's retry paces further attempts. The
// dial and the channel's requests run aside, and ready gives them up when
// ctx ends: they end only at DialTimeout, or when the heartbeats find the
// broker silent.
func (p *publisher) ready(ctx context.Context) error {
	if p.closed {
		return fmt.Errorf("amqp: dead-letter publisher: %w", ErrChannelClosed)
	}
	redeclare := p.redeclare && !p.cfg.Passive
	reusable := p.conn != nil && !p.conn.IsClosed() && p.blocked.get() == ""
	if redeclare && !reusable {
		// Declare on a new connection: one the broker blocks under an
		// alarm would hold the declarations (amqp091 gives its requests
		// no deadline), and a fresh one is not blocked before it
		// publishes.
		p.drop()
	}
	if !redeclare && p.ch != nil && !p.ch.IsClosed() && !p.conn.IsClosed() {
		return nil
	}
	if reusable {
		// A refusal of the broker (an exchange missing, internal or not
		// writable, a declaration refused) closes the channel, not the
		// connection. Such refusals last until they are fixed on the
		// broker, and a connection dialled for each retry would churn
		// connections there for as long: a channel is opened on the
		// same connection instead, and the destination declared on it.
		// A blocked connection would hold the channel's requests, and is
		// dropped.
		if redeclare {
			p.redeclare = false
		}
		return p.reopenChannel(ctx, redeclare)
	}
	p.drop()
	type opened struct {
		conn *amqp091.Connection
		ch   *amqp091.Channel
		err  error
	}
	wrote := new(atomic.Int64)
	done := make(chan opened, 1)
	go func() {
		conn, ch, err := p.open(redeclare, wrote)
		done <- opened{conn, ch, err}
	}()
	var o opened
	select {
	case o = <-done:
	case <-ctx.Done():
		go func() {
			if o := <-done; o.conn != nil {
				_ = o.conn.CloseDeadline(time.Now().Add(time.Second))
			}
		}()
		return fmt.Errorf("amqp: open the dead-letter connection: %w", ctx.Err())
	}
	if redeclare {
		// Once per copy found unroutable: if something else declared the
		// destination meanwhile, with other arguments, the next attempt
		// publishes without declaring.
		p.redeclare = false
	}
	if o.err != nil {
		return o.err
	}
	if redeclare {
		p.log.Info("amqp: declared the dead-letter destination again; a copy had found it missing")
	}
	conn, ch := o.conn, o.ch
	blocked := newBlockState()
	notes := conn.NotifyBlocked(make(chan amqp091.Blocking, 4))
	go func() {
		for n := range notes { // closed with the connection
			blocked.set(n)
			if n.Active {
				p.log.Warn("amqp: the broker blocked the dead-letter connection; dead letters wait, consuming goes on", "reason", n.Reason)
			} else {
				p.log.Info("amqp: the broker unblocked the dead-letter connection")
			}
		}
	}()
	p.conn, p.blocked, p.wrote = conn, blocked, wrote
	p.useChannel(ch)
	return nil
}

// useChannel makes ch, in confirm mode, the channel copies are published
// on. A publish left pending went with the channel before it.
func (p *publisher) useChannel(ch *amqp091.Channel) {
	p.ch, p.pending, p.pendingFor = ch, nil, nil
	p.returns = ch.NotifyReturn(make(chan amqp091.Return, 4))
	p.chClosed = ch.NotifyClose(make(chan *amqp091.Error, 1))
}

// reopenChannel opens a confirm-mode channel on the dead-letter
// connection, declares the dead-letter destination on it first when
// redeclare is set, and publishes on it from now on; the channel before
// it, if still open, is closed. The requests run aside, given up when ctx
// ends or after ConfirmTimeout (the broker may have blocked the connection
// without its notice having come yet); a connection that fails them is
// dropped, and the next attempt dials. A declaration the broker refuses
// closes the new channel only: the connection is kept for the next
// attempt.
func (p *publisher) reopenChannel(ctx context.Context, redeclare bool) error {
	conn, old := p.conn, p.ch
	if old != nil && !old.IsClosed() {
		go func() { _ = old.Close() }()
	}
	p.ch = nil
	type opened struct {
		ch         *amqp091.Channel
		err        error
		declareErr error
	}
	done := make(chan opened, 1)
	go func() {
		ch, err := conn.Channel()
		if err == nil {
			if err = ch.Confirm(false); err != nil {
				_ = ch.Close()
			}
		}
		if err != nil {
			done <- opened{err: err}
			return
		}
		if redeclare {
			if err := declareDeadLetter(ch, p.cfg); err != nil {
				_ = ch.Close()
				done <- opened{declareErr: err}
				return
			}
		}
		done <- opened{ch: ch}
	}()
	// A channel not opened declared nothing: the next attempt, on a
	// connection dialled anew, declares instead. Else it would publish
	// undeclared, be unroutable again, and come back here (under a
	// channel_max of 1 the old channel's close is still in flight, and
	// the two alternated for ever).
	undeclared := func() {
		if redeclare {
			p.redeclare = true
		}
	}
	t := time.NewTimer(p.cfg.ConfirmTimeout)
	defer t.Stop()
	var o opened
	select {
	case o = <-done:
	case <-ctx.Done():
		p.drop() // the stuck requests end with the connection
		undeclared()
		return fmt.Errorf("amqp: open the dead-letter channel: %w", ctx.Err())
	case <-t.C:
		p.drop()
		undeclared()
		return fmt.Errorf("amqp: open the dead-letter channel: no answer within Config.ConfirmTimeout %v", p.cfg.ConfirmTimeout)
	}
	switch {
	case o.declareErr != nil:
		return fmt.Errorf("amqp: declare the dead-letter destination again: %w", o.declareErr)
	case o.err != nil:
		p.drop()
		undeclared()
		return fmt.Errorf("amqp: open the dead-letter channel: %w", o.err)
	}
	if redeclare {
		p.log.Info("amqp: declared the dead-letter destination again; a copy had found it missing")
	}
	p.useChannel(o.ch)
	return nil
}

// open dials the dead-letter connection, its writes recorded in wrote, and
// opens its channel in confirm mode, declaring the dead-letter destination
// first when redeclare is set.
func (p *publisher) open(redeclare bool, wrote *atomic.Int64) (*amqp091.Connection, *amqp091.Channel, error) {
	conn, err := dialClocked(p.cfg, p.cfg.ConnectionName+" (dead letters)", wrote)
	if err != nil {
		return nil, nil, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		_ = conn.CloseDeadline(time.Now().Add(time.Second))
		return nil, nil, fmt.Errorf("amqp: open the dead-letter channel: %w", err)
	}
	if redeclare {
		if err := declareDeadLetter(ch, p.cfg); err != nil {
			_ = conn.CloseDeadline(time.Now().Add(time.Second))
			return nil, nil, fmt.Errorf("amqp: declare the dead-letter destination again: %w", err)
		}
	}
	return conn, ch, nil
}

// drainReturns discards returns left by an earlier publish. The channel
// may have closed since ready (while settlePending waited): its returns
// channel is then closed, and the publish that follows fails.
func (p *publisher) drainReturns() {
	for {
		select {
		case _, ok := <-p.returns:
			if !ok {
				return
			}
		default:
			return
		}
	}
}

// drop abandons the connection without waiting for the broker, which may
// be what is stuck.
func (p *publisher) drop() {
	if p.conn == nil {
		return
	}
	go func(conn *amqp091.Connection) { _ = conn.CloseDeadline(time.Now().Add(2 * time.Second)) }(p.conn)
	p.conn, p.ch, p.returns, p.chClosed, p.pending, p.pendingFor = nil, nil, nil, nil, nil, nil
	p.blocked = newBlockState()
}

// close closes the connection; later publishes fail. A connection the
// broker blocks (a resource alarm) reads nothing, its close is never
// answered: it is closed aside, as drop does, and close returns at once.
// A copy left unconfirmed on it may still reach the dead-letter queue; its
// delivery was not acked and comes back.
func (p *publisher) close() {
	p.closeOnce.Do(func() { close(p.closing) })
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	if p.conn == nil {
		return
	}
	if p.blocked.get() != "" {
		p.drop()
		return
	}
	_ = p.conn.CloseDeadline(time.Now().Add(2 * time.Second))
	p.conn, p.ch, p.returns, p.chClosed = nil, nil, nil, nil
}

// errNacked is wrapped by the error of a dead-letter copy the broker
// nacked. RabbitMQ nacks a publish that a queue it routes to refused: a
// queue at its length limit (x-max-length, x-max-length-bytes) whose
// overflow is reject-publish or reject-publish-dlx refuses every copy
// until it has room again, which only someone draining it or raising the
// limit gives it (a copy larger than x-max-length-bytes is refused by the
// empty queue too: only raising the limit does); or a queue that cannot
// take messages at all (a quorum queue without a majority of its members,
// an internal error).
var errNacked = errors.New("the broker nacked it: a queue it routes to refused it " +
	"(the dead-letter queue full under x-overflow reject-publish, or the copy larger than its x-max-length-bytes? drain it or raise its limit)")

// errUnroutable is wrapped by the error of a dead-letter copy the broker
// returned as unroutable.
var errUnroutable = errors.New("no queue is bound to take it")

// destinationMissing reports whether err is a dead-letter copy that found
// its exchange missing (NOT_FOUND) or no queue bound to take it.
func destinationMissing(err error) bool {
	var ae *amqp091.Error
	return errors.Is(err, errUnroutable) || errors.As(err, &ae) && ae.Code == amqp091.NotFound
}

// accessRefused reports whether err is the broker's ACCESS_REFUSED: the
// user may not publish to the exchange (or, under topic permissions, with
// the routing key), or the exchange is internal. Retrying does not change
// it; a change on the broker does.
func accessRefused(err error) bool {
	var ae *amqp091.Error
	return errors.As(err, &ae) && ae.Code == amqp091.AccessRefused
}

// exchangeName names exchange in errors and logs, the default one too.
func exchangeName(exchange string) string {
	if exchange == "" {
		return `"" (the default exchange, amq.default)`
	}
	return fmt.Sprintf("%q", exchange)
}

// checkDeadLetterWrite makes sure, at Open, that the broker lets the
// source publish its dead-letter copies: declaring (or, with Passive,
// checking) the dead-letter exchange needs no permission to write to it,
// and an internal exchange passes a passive check, whereas the broker
// refuses each copy published to such an exchange (ACCESS_REFUSED), which
// would be found only at the first dead letter, retried for ever.
//
// It publishes an empty message with the copies' exchange and routing key
// in an AMQP transaction it rolls back, on a connection of its own (under
// a resource alarm the broker blocks a connection that publishes, and the
// consuming one must not be): the broker checks the permissions and the
// exchange when the message is published, and a transaction rolled back
// delivers nothing to any queue. A refusal is returned; a check that
// cannot be made (a dial that fails, a connection limit, a broker that
// blocks the connection or does not answer within ConfirmTimeout) is
// logged and skipped. It runs in the first connection attempt, before the
// source consumes, which runs aside and is bounded by DialTimeout and
// ConfirmTimeout: Open gives it up when its context ends.
func (s *Source) checkDeadLetterWrite() error {
	cfg := &s.cfg
	exchange, key := cfg.DeadLetter.Exchange, cfg.DeadLetter.RoutingKey
	skip := func(why string, err error) error {
		args := []any{"exchange", exchange, "routing_key", key, "reason", why}
		if err != nil {
			args = append(args, "error", redactErr(err, cfg.URL))
		}
		s.log.Warn("amqp: could not check that the broker accepts dead-letter copies; a refusal would show at the first dead letter", args...)
		return nil
	}
	conn, err := dial(cfg, cfg.ConnectionName+" (dead letters)")
	if err != nil {
		return skip("cannot connect", err)
	}
	// Closed aside when the check is not answered: a connection the broker
	// blocks may not take the close. Once answered, closed before the
	// source consumes.
	closeAside := func() { go func() { _ = conn.CloseDeadline(time.Now().Add(time.Second)) }() }
	blocked := conn.NotifyBlocked(make(chan amqp091.Blocking, 1))
	done := make(chan error, 1)
	go func() { done <- probeWrite(conn, exchange, key) }()
	t := time.NewTimer(cfg.ConfirmTimeout)
	defer t.Stop()
	for {
		select {
		case err := <-done:
			_ = conn.CloseDeadline(time.Now().Add(time.Second))
			switch {
			case accessRefused(err):
				return &configError{fmt.Errorf("amqp: Config.DeadLetter.Exchange %s: the broker refuses the source's publishes to it with routing key %q, "+
					"so no dead letter could be written: %w; grant the user permission to write to it, or name an exchange that is not internal",
					exchangeName(exchange), key, redactErr(err, cfg.URL))}
			case err != nil:
				return skip("the check failed", err)
			}
			return nil
		case b := <-blocked:
			if b.Active {
				closeAside()
				return skip("the broker blocks publishing connections (resource alarm)", errors.New(b.Reason))
			}
		case <-t.C:
			closeAside()
			return skip("no answer within Config.ConfirmTimeout", nil)
		case <-s.closeCh:
			closeAside()
			return consumer.ErrSourceClosed
		}
	}
}

// probeWrite publishes an empty message to exchange with key in a
// transaction that it rolls back, on a channel of conn it closes: the
// broker refuses the publish as it would a dead-letter copy's, and routes
// nothing.
func probeWrite(conn *amqp091.Connection, exchange, key string) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	closed := ch.NotifyClose(make(chan *amqp091.Error, 1))
	if err := ch.Tx(); err != nil {
		return err
	}
	err = ch.Publish(exchange, key, false, false, amqp091.Publishing{})
	if err == nil {
		err = ch.TxRollback()
	}
	if err != nil {
		// The broker answers a refused publish by closing the channel:
		// the rollback then fails with its reason, or, when the close
		// came first, with a closed channel, and the reason comes here.
		t := time.NewTimer(time.Second)
		defer t.Stop()
		select {
		case e, ok := <-closed:
			if ok && e != nil {
				return e
			}
		case <-t.C:
		}
		return err
	}
	return ch.Close()
}
