package amqp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
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
// the next publish, independently of the consuming connection.
type publisher struct {
	cfg *Config
	log *slog.Logger

	mu      sync.Mutex // serialises publishes: a basic.return belongs to the publish in progress
	conn    *amqp091.Connection
	ch      *amqp091.Channel
	returns chan amqp091.Return
	blocked *blockState
	closed  bool
}

// blockState is what the connection.blocked notifications of one
// connection last said.
type blockState struct {
	mu     sync.Mutex
	reason string // "" when not blocked
}

func (b *blockState) set(n amqp091.Blocking) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reason = ""
	if n.Active {
		b.reason = n.Reason
		if b.reason == "" {
			b.reason = "no reason given"
		}
	}
}

func (b *blockState) get() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.reason
}

func newPublisher(cfg *Config, log *slog.Logger) *publisher {
	return &publisher{cfg: cfg, log: log, blocked: &blockState{}}
}

// publish publishes p mandatory to exchange with key and waits for the
// broker's confirm, at most timeout.
func (p *publisher) publish(ctx context.Context, exchange, key string, msg amqp091.Publishing, timeout time.Duration) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.ready(); err != nil {
		return err
	}
	if reason := p.blocked.get(); reason != "" {
		return fmt.Errorf("%w: %s", ErrPublisherBlocked, reason)
	}
	p.drainReturns()
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	dc, err := p.ch.PublishWithDeferredConfirmWithContext(wctx, exchange, key, true, false, msg)
	if err != nil {
		p.drop()
		return fmt.Errorf("amqp: publish to exchange %q with key %q: %w", exchange, key, err)
	}
	acked, err := dc.WaitContext(wctx)
	if err != nil {
		// The confirm may still come, or the connection is stuck (blocked,
		// or the network gone): a new connection keeps a late confirm from
		// being taken for the next publish's, and costs the consumer
		// nothing.
		p.drop()
		if reason := p.blocked.get(); reason != "" {
			return fmt.Errorf("%w: %s", ErrPublisherBlocked, reason)
		}
		if ctx.Err() == nil {
			return fmt.Errorf("amqp: no publisher confirm within Config.ConfirmTimeout %v for exchange %q key %q", timeout, exchange, key)
		}
		return fmt.Errorf("amqp: wait for publisher confirm: %w", err)
	}
	if !acked {
		return fmt.Errorf("amqp: the broker nacked the publish to exchange %q with key %q", exchange, key)
	}
	select {
	case r := <-p.returns:
		return fmt.Errorf("amqp: publish to exchange %q with key %q was unroutable: %d %s", exchange, key, r.ReplyCode, r.ReplyText)
	default:
	}
	return nil
}

// ready makes sure a connection and a confirm-mode channel are open,
// dialling once if not: the caller's retry paces further attempts.
func (p *publisher) ready() error {
	if p.closed {
		return fmt.Errorf("amqp: dead-letter publisher: %w", ErrChannelClosed)
	}
	if p.ch != nil && !p.ch.IsClosed() && !p.conn.IsClosed() {
		return nil
	}
	p.drop()
	conn, err := dial(p.cfg, p.cfg.ConnectionName+" (dead letters)")
	if err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		_ = conn.CloseDeadline(time.Now().Add(time.Second))
		return fmt.Errorf("amqp: open the dead-letter channel: %w", err)
	}
	blocked := &blockState{}
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
	p.conn, p.ch, p.blocked = conn, ch, blocked
	p.returns = ch.NotifyReturn(make(chan amqp091.Return, 4))
	return nil
}

// drainReturns discards returns left by an earlier publish.
func (p *publisher) drainReturns() {
	for {
		select {
		case <-p.returns:
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
	p.conn, p.ch, p.returns = nil, nil, nil
	p.blocked = &blockState{}
}

// close closes the connection; later publishes fail.
func (p *publisher) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	if p.conn != nil {
		_ = p.conn.CloseDeadline(time.Now().Add(2 * time.Second))
		p.conn, p.ch, p.returns = nil, nil, nil
	}
}
