package amqp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/backoff"
	"github.com/onceco/once/internal/tlsfail"
	"github.com/onceco/once/internal/writeclock"
)

// instrumentationName names the OpenTelemetry meter of this package.
const instrumentationName = "github.com/onceco/once/brokers/amqp"

// ReconnectsMetric is the name of the OpenTelemetry counter of successful
// reconnections after a lost connection or channel. Its attributes are
// messaging.system ("rabbitmq") and messaging.destination.name (the queue).
const ReconnectsMetric = "once.amqp.reconnects"

// DeadLetterRefusalsMetric is the name of the OpenTelemetry counter of
// dead-letter copies the broker refused with ACCESS_REFUSED (the user may
// not publish to Config.DeadLetter.Exchange, or with its routing key, or
// the exchange is internal) or nacked (a queue refused the copy: the
// dead-letter queue full under x-overflow reject-publish, or a queue that
// cannot take messages), and of those found missing (the exchange, or a
// queue bound to take the copy) where the source declares nothing that
// would bring them back (Config.Passive, DeadLetter.NoQueue). Each is
// also logged at level Error; the
// delivery stays unacked and the consumer retries it, and only a change on
// the broker ends the refusals. Its attributes are those of
// ReconnectsMetric.
const DeadLetterRefusalsMetric = "once.amqp.dead_letter.refusals"

// ErrChannelClosed is returned (wrapped) by Delivery.Ack and
// Delivery.DeadLetter for a delivery whose AMQP channel closed: delivery
// tags belong to a channel, so the delivery cannot be settled any more and
// the broker delivers the message again.
var ErrChannelClosed = errors.New("amqp: the delivery's channel closed; the broker will deliver the message again")

// Source consumes one RabbitMQ queue for a consumer.Consumer. It implements
// consumer.Source and consumer.SystemNamer.
//
// The source owns two connections. One consumes with manual
// acknowledgements and the configured prefetch; the other, dialled on the
// first dead letter, publishes dead-letter copies in confirm mode. They are
// apart because RabbitMQ blocks a publishing connection under a memory or
// disk alarm, and a blocked connection would stall the acks too; each
// reconnects on its own. When the consuming connection or channel is lost,
// Receive reconnects with exponential backoff and jitter, declares the
// topology again, applies the prefetch and resumes consuming, blocking
// meanwhile. Deliveries received before the loss have their
// Context cancelled and cannot be acked; the broker delivers them again.
//
// Receive must be called from one goroutine at a time; the deliveries it
// returns may be settled from any goroutine.
type Source struct {
	cfg        Config
	log        *slog.Logger
	pub        *publisher
	reconnects metric.Int64Counter
	refusals   metric.Int64Counter // DeadLetterRefusalsMetric
	attrs      metric.MeasurementOption
	// version is the broker's, from the connection Open made (its version
	// property; "" when it sent none); set before Open returns.
	version string

	closeCh chan struct{}

	mu        sync.Mutex
	sess      *session // the live session; nil while disconnected
	closed    bool
	connected bool // a session was established at least once
	lostAt    time.Time
	// flaps counts the sessions in a row that died before Receive
	// returned any of their deliveries and within ReconnectMaxBackoff of
	// being established; the next reconnect first waits as after as many
	// failed attempts. A message the client library cannot read (more
	// header entries or nesting than amqp091 accepts) closes each new
	// connection at once, the broker delivering it first every time.
	flaps int
	// attempting is the connection attempt in progress, if any; one
	// given up by a call whose context ended stays here for the next.
	attempting *connAttempt
}

// Open validates cfg, connects to the broker, declares (or, with
// Config.Passive, checks) the topology and starts consuming. A broker that
// cannot be reached is retried with backoff until ctx is done; an error the
// broker gives for the configuration itself (access refused: wrong
// credentials, no access to the vhost, no permission on the queue; a
// missing queue in passive mode, a queue declared with other arguments,
// a queue of that name exclusive to another connection)
// and a TLS handshake that fails for the configuration (a certificate not
// trusted or not presented, an amqps URL at a port that speaks plain AMQP)
// are returned at once. A connection limit reached (the vhost's or the
// user's) is waited for, as a broker that cannot be reached: connections
// that close free it. Config errors name the offending field.
//
// Open also refuses a dead-letter exchange the broker would refuse every
// copy to (the user may not write to it, or it is internal, which
// Config.Passive's check lets pass): it publishes an empty message with
// the copies' exchange and routing key in an AMQP transaction that it rolls
// back, on a short-lived connection of its own, so that nothing reaches
// any queue, before it starts consuming. When that check cannot be made (the connection refused, the
// broker blocking it under a resource alarm, no answer within
// Config.ConfirmTimeout) it is logged at level Warn and skipped.
//
// Once connected, the source reconnects after a lost connection with
// backoff, for as long as Receive's context allows, and it does so too
// when the broker refuses it on a reconnect (the password changed or the
// permissions revoked on the broker, a certificate expired, an exchange or
// queue of the topology changed there so that its declaration is refused,
// or deleted under Config.Passive): the same
// Config was accepted before, so the change was made on the broker's side,
// where undoing it lets the source resume without a restart, whereas a
// source that stopped would take its consumer down and be refused again
// when restarted with the same Config. Such a refusal is logged at level
// Error, as the broker refusing the configuration with its reason (for a
// refused declaration, the exchange or queue and what to change), not as
// a broker that cannot be reached; Close (or Receive's context) ends the
// retrying.
func Open(ctx context.Context, cfg Config) (*Source, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	mp := cfg.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	counter, err := mp.Meter(instrumentationName).Int64Counter(ReconnectsMetric,
		metric.WithDescription("Reconnections of the RabbitMQ source after a lost connection or channel."),
		metric.WithUnit("{reconnect}"))
	if err != nil {
		return nil, fmt.Errorf("amqp: create %s counter: %w", ReconnectsMetric, err)
	}
	refusals, err := mp.Meter(instrumentationName).Int64Counter(DeadLetterRefusalsMetric,
		metric.WithDescription("Dead-letter copies the RabbitMQ broker refused with ACCESS_REFUSED (no permission to publish to the exchange, or an internal exchange) or nacked (a queue refused them: the dead-letter queue full under x-overflow reject-publish)."),
		metric.WithUnit("{copy}"))
	if err != nil {
		return nil, fmt.Errorf("amqp: create %s counter: %w", DeadLetterRefusalsMetric, err)
	}
	s := &Source{
		cfg:        cfg,
		log:        cfg.Logger.With("queue", cfg.Queue, "broker", redactURL(cfg.URL)),
		reconnects: counter,
		refusals:   refusals,
		attrs: metric.WithAttributeSet(attribute.NewSet(
			attribute.String("messaging.system", "rabbitmq"),
			attribute.String("messaging.destination.name", cfg.Queue))),
		closeCh: make(chan struct{}),
	}
	s.pub = newPublisher(&s.cfg, s.log)
	sess, err := s.reconnect(ctx)
	if err != nil {
		_ = s.Close() // and the attempt given up, if any
		return nil, err
	}
	version, _ := sess.conn.Properties["version"].(string)
	s.version = version
	s.warnDeliveryLimits(version)
	s.warnDroppingArgs()
	return s, nil
}

// DeliveryLimit implements consumer.DeliveryLimiter: how many times the
// quorum queue the source declared delivers a message again before the
// broker takes it away (to the queue's x-dead-letter-exchange, without the
// consumer's diagnostic headers, or dropped without one): its
// x-delivery-limit in Config.QueueArgs, or RabbitMQ 4's default of 20
// when none is given. 0 for a classic queue, which has no such limit, and
// with Config.Passive, where the queue's arguments are not known (nor are
// a policy's, here or anywhere).
func (s *Source) DeliveryLimit() int64 {
	if s.cfg.QueueType != QueueQuorum || s.cfg.Passive {
		return 0
	}
	return deliveryLimit(s.cfg.QueueArgs, s.version)
}

// warnDeliveryLimits logs a warning for each quorum queue the source
// declared with a delivery limit and no dead-letter exchange, on a broker
// of the given version: the broker drops a message returned to it more
// often than the limit, and every unacked message is returned at each lost
// connection, restart and shutdown (each read of the dead letters by once
// dlq too). A policy may supply the dead-letter exchange, which the source
// cannot see, so it is not refused. With Passive nothing is declared and
// the queues' arguments are unknown.
func (s *Source) warnDeliveryLimits(version string) {
	if s.cfg.QueueType != QueueQuorum || s.cfg.Passive {
		return
	}
	for _, q := range s.declaredQueues() {
		limit := deliveryLimitRisk(q.args, version)
		if limit == 0 {
			continue
		}
		_, given := q.args[deliveryLimitArg]
		s.log.Warn("amqp: a quorum queue with an x-delivery-limit and no x-dead-letter-exchange drops a message returned to it more often "+
			"than the limit (every unacked message is returned at each lost connection, restart or shutdown, and by each read of the dead "+
			"letters); unless a policy gives the queue a dead-letter exchange, add x-dead-letter-exchange, or on RabbitMQ 4 declare the "+
			"queue with x-delivery-limit -1 (docs/amqp.md, Pitfalls)",
			"dropping_queue", q.queue, "field", q.field, "x-delivery-limit", limit, "rabbitmq_default", !given, "rabbitmq_version", version)
	}
	s.warnDeadLetterQueueLimit(version)
}

// warnDeadLetterQueueLimit logs a warning when the quorum dead-letter queue
// the source declares has a delivery limit and a dead-letter exchange of
// its own (without one, warnDeliveryLimits warns that it drops): every
// read of the dead letters (once dlq list, show and replay, each page of
// the console) takes them and puts them back, which the queue counts as a
// delivery, so that many reads move every dead letter out of the
// dead-letter queue, to that exchange, where once dlq no longer sees it.
func (s *Source) warnDeadLetterQueueLimit(version string) {
	args := s.cfg.DeadLetter.QueueArgs
	if s.cfg.DeadLetter.Queue == "" || deliveryLimitRisk(args, version) > 0 {
		return
	}
	limit := deliveryLimit(args, version)
	if limit == 0 {
		return
	}
	_, given := args[deliveryLimitArg]
	s.log.Warn("amqp: the quorum dead-letter queue has an x-delivery-limit: each read of the dead letters (once dlq list, show or replay, "+
		"a page of the console) returns them to the queue, which counts as a delivery, and past the limit the broker moves each dead letter "+
		"to the queue's x-dead-letter-exchange, out of reach of once dlq; declare the dead-letter queue without a limit "+
		"(on RabbitMQ 4, x-delivery-limit -1; docs/amqp.md, Pitfalls)",
		"dead_letter_queue", s.cfg.DeadLetter.Queue, "field", "Config.DeadLetter.QueueArgs", "x-delivery-limit", limit,
		"rabbitmq_default", !given, "rabbitmq_version", version)
}

// declaredQueue is a queue the source declares, with the Config field
// that holds its arguments.
type declaredQueue struct {
	field, queue string
	args         amqp091.Table
}

// declaredQueues returns the source's queue and its dead-letter queue,
// unless DeadLetter.NoQueue.
func (s *Source) declaredQueues() []declaredQueue {
	qs := []declaredQueue{{"Config.QueueArgs", s.cfg.Queue, s.cfg.QueueArgs}}
	if s.cfg.DeadLetter.Queue != "" {
		qs = append(qs, declaredQueue{"Config.DeadLetter.QueueArgs", s.cfg.DeadLetter.Queue, s.cfg.DeadLetter.QueueArgs})
	}
	return qs
}

// MessagingSystem returns "rabbitmq", the OpenTelemetry messaging.system.
func (s *Source) MessagingSystem() string { return "rabbitmq" }

// Receive returns the next delivery of the queue. It blocks until one
// arrives or ctx is done (it then returns ctx.Err()). While the connection
// is lost it keeps blocking and reconnects. It returns
// consumer.ErrSourceClosed once Close was called.
func (s *Source) Receive(ctx context.Context) (consumer.Delivery, error) {
	for {
		sess, err := s.current(ctx)
		if err != nil {
			return nil, err
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-s.closeCh:
			return nil, consumer.ErrSourceClosed
		case <-sess.ctx.Done():
			s.lost(sess, context.Cause(sess.ctx))
		case d, ok := <-sess.deliveries:
			if !ok {
				s.lost(sess, sess.endCause())
				continue
			}
			if sess.ctx.Err() != nil {
				// Buffered from a channel that died meanwhile: it cannot be
				// acked, and the broker delivers it again.
				s.lost(sess, context.Cause(sess.ctx))
				continue
			}
			if sess.streamUnchecked && fromStream(d) {
				err := streamQueueError(s.cfg.Queue, "its deliveries carry the stream's x-stream-offset header")
				s.lost(sess, err)
				return nil, err
			}
			if !sess.delivered.Load() {
				sess.delivered.Store(true)
			}
			return s.newDelivery(sess, d), nil
		}
	}
}

// Close stops consuming and closes the connections. Deliveries not yet
// acked go back to the queue, those whose dead-letter copy is not
// confirmed too. A dead-letter connection the broker blocks under a
// resource alarm, which would never answer its close, is closed without
// waiting. It is safe to call more than once.
func (s *Source) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.closeCh)
	sess := s.sess
	s.sess = nil
	if a := s.attempting; a != nil {
		s.attempting = nil
		go func() {
			<-a.done
			if a.sess != nil {
				_ = a.sess.close(consumer.ErrSourceClosed)
			}
		}()
	}
	s.mu.Unlock()
	s.pub.close()
	if sess == nil {
		return nil
	}
	return sess.close(consumer.ErrSourceClosed)
}

// current returns the live session, reconnecting when there is none.
func (s *Source) current(ctx context.Context) (*session, error) {
	s.mu.Lock()
	closed, sess := s.closed, s.sess
	s.mu.Unlock()
	if closed {
		return nil, consumer.ErrSourceClosed
	}
	if sess != nil {
		return sess, nil
	}
	return s.reconnect(ctx)
}

// lost drops sess after its connection or channel failed.
func (s *Source) lost(sess *session, cause error) {
	s.mu.Lock()
	if s.sess == sess {
		s.sess = nil
		s.lostAt = time.Now()
		if !sess.delivered.Load() && s.lostAt.Sub(sess.started) < s.cfg.ReconnectMaxBackoff {
			s.flaps++
		} else {
			s.flaps = 0
		}
	}
	closed := s.closed
	s.mu.Unlock()
	_ = sess.close(cause)
	var refused *configError
	switch {
	case closed:
	case errors.As(cause, &refused):
		// Receive returns it: not a connection lost.
	case consumerTimedOut(cause):
		s.log.Error("amqp: the broker closed the consuming channel because a delivery stayed unacked longer than its consumer_timeout "+
			"(30 minutes by default): every unacked delivery of the channel is delivered again, and a handler that runs as long is "+
			"cut again each time, until the consumer dead-letters the message as a crash loop (consumer.Config.CrashGuard.MaxCrashes); "+
			"bound consumer.Config.HandlerTimeout well below consumer_timeout, and a message's "+
			"retries within it, or raise it on the broker; reconnecting",
			"error", cause)
	case unreadable(cause):
		s.log.Error("amqp: the client library cannot read a message the broker delivered (more header entries or "+
			"nesting than amqp091 accepts); the broker delivers it first again on every connection, and the queue "+
			"waits behind it: remove it from the queue (a quorum queue's x-delivery-limit dead-letters it); reconnecting",
			"cause", cause)
	default:
		s.log.Warn("amqp: connection to the broker lost; reconnecting", "cause", cause)
	}
}

// unreadable reports whether cause is the client library's refusal of a
// frame it received: a syntax error it raised itself (amqp091 closes the
// connection with a frame error whose reason is that syntax error), not a
// lost connection (a frame error too, its reason the read's error) nor the
// broker's.
func unreadable(cause error) bool {
	var ae *amqp091.Error
	return errors.As(cause, &ae) && !ae.Server &&
		(ae.Code == amqp091.SyntaxError || strings.Contains(ae.Reason, amqp091.ErrSyntax.Reason))
}

// consumerTimedOut reports whether cause is the broker closing the
// consuming channel for a delivery left unacked longer than its
// consumer_timeout: PRECONDITION_FAILED, "delivery acknowledgement on
// channel N timed out".
func consumerTimedOut(cause error) bool {
	var ae *amqp091.Error
	return errors.As(cause, &ae) && ae.Server && ae.Code == amqp091.PreconditionFailed &&
		strings.Contains(ae.Reason, "acknowledgement") && strings.Contains(ae.Reason, "timed out")
}

// flapWait is how long a reconnect waits before its first attempt: as
// after failed attempts, one for each session in a row that flapped.
func (s *Source) flapWait() time.Duration {
	s.mu.Lock()
	n := s.flaps
	s.mu.Unlock()
	if n == 0 {
		return 0
	}
	return backoff.Policy{Initial: s.cfg.ReconnectMinBackoff, Max: s.cfg.ReconnectMaxBackoff}.Delay(n)
}

// reconnect establishes a session, retrying with exponential backoff and
// jitter until ctx is done or the source is closed. Before the first
// success, configuration errors are returned at once.
func (s *Source) reconnect(ctx context.Context) (*session, error) {
	retry := backoff.Retrier{Policy: backoff.Policy{Initial: s.cfg.ReconnectMinBackoff, Max: s.cfg.ReconnectMaxBackoff}}
	if wait := s.flapWait(); wait > 0 {
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-s.closeCh:
			t.Stop()
			return nil, consumer.ErrSourceClosed
		case <-t.C:
		}
	}
	var lastErr error
	for attempt := 1; ; attempt++ {
		sess, err := s.attempt(ctx)
		if errors.Is(err, errGivenUp) {
			s.mu.Lock()
			connected := s.connected
			s.mu.Unlock()
			switch {
			case ctx.Err() == nil:
				return nil, consumer.ErrSourceClosed
			case connected:
				return nil, ctx.Err()
			case lastErr != nil:
				return nil, fmt.Errorf("amqp: connect: %w (last error: %w)", ctx.Err(), lastErr)
			default:
				return nil, fmt.Errorf("amqp: connect: %w (the first attempt had not finished)", ctx.Err())
			}
		}
		if err == nil {
			s.mu.Lock()
			if s.closed {
				s.mu.Unlock()
				_ = sess.close(consumer.ErrSourceClosed)
				return nil, consumer.ErrSourceClosed
			}
			again, lostAt := s.connected, s.lostAt
			s.sess, s.connected = sess, true
			s.mu.Unlock()
			if again {
				s.reconnects.Add(context.Background(), 1, s.attrs)
				s.log.Info("amqp: reconnected to the broker", "attempts", attempt, "downtime", time.Since(lostAt).Round(time.Millisecond))
			}
			return sess, nil
		}
		if errors.Is(err, consumer.ErrSourceClosed) {
			return nil, err // connect saw the source closed
		}
		s.mu.Lock()
		connected := s.connected
		s.mu.Unlock()
		if !connected && isConfigError(err) {
			return nil, err
		}
		lastErr = err
		wait := retry.Delay()
		if isConfigError(err) {
			// Connected before with the same configuration: changed on the
			// broker's side, and fixed there (see Open).
			s.log.Error(refusalMessage(err), "attempt", attempt, "retry_in", wait.Round(time.Millisecond), "error", err)
		} else {
			s.log.Warn("amqp: cannot connect to the broker; retrying", "attempt", attempt, "retry_in", wait.Round(time.Millisecond), "error", err)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			if connected {
				return nil, ctx.Err()
			}
			return nil, fmt.Errorf("amqp: connect: %w (last error: %w)", ctx.Err(), err)
		case <-s.closeCh:
			t.Stop()
			return nil, consumer.ErrSourceClosed
		case <-t.C:
		}
	}
}

// errGivenUp is attempt's error when it gave up a connection attempt.
var errGivenUp = errors.New("amqp: connection attempt given up")

// connAttempt is one connection attempt running aside: sess and err are
// set when done is closed.
type connAttempt struct {
	done chan struct{}
	sess *session
	err  error
}

// attempt makes one connection attempt aside and waits for it until ctx
// ends or the source is closed; it then returns errGivenUp at once. The
// dial and the channel's requests end only at DialTimeout or when the
// heartbeats find the broker silent, tens of seconds that Receive's and
// Open's contexts and Close must not wait. An attempt given up goes on:
// the next call takes its outcome instead of starting another, and Close
// closes the session it opens.
func (s *Source) attempt(ctx context.Context) (*session, error) {
	s.mu.Lock()
	a := s.attempting
	if a == nil {
		a = &connAttempt{done: make(chan struct{})}
		s.attempting = a
		go func() {
			a.sess, a.err = s.connect()
			close(a.done)
		}()
	}
	s.mu.Unlock()
	select {
	case <-a.done:
		s.mu.Lock()
		if s.attempting == a {
			s.attempting = nil
		}
		s.mu.Unlock()
		return a.sess, a.err
	case <-ctx.Done():
	case <-s.closeCh:
	}
	return nil, errGivenUp
}

// isConfigError reports whether err is the broker's verdict on the
// configuration (credentials, permissions, topology, TLS), which retrying
// does not change.
func isConfigError(err error) bool {
	var ce *configError
	if tlsRefused(err) || errors.As(err, &ce) {
		return true
	}
	if errors.Is(err, amqp091.ErrSASL) || errors.Is(err, amqp091.ErrCredentials) || errors.Is(err, amqp091.ErrVhost) {
		return true
	}
	var ae *amqp091.Error
	if errors.As(err, &ae) {
		switch ae.Code {
		case amqp091.NotAllowed:
			// Also a connection limit reached (the vhost's or the
			// user's), which connections that close free: capacity,
			// which waiting may cure.
			return !strings.Contains(ae.Reason, "connection limit")
		case amqp091.AccessRefused, amqp091.NotFound, amqp091.PreconditionFailed, amqp091.CommandInvalid, amqp091.NotImplemented:
			return true
		case amqp091.ResourceLocked:
			// The queue is exclusive to another connection: a name the
			// configuration shares with another client's queue, not a
			// broker out of reach.
			return true
		}
	}
	return false
}

// declareError is a declaration of the topology (or, with Config.Passive,
// a check) that the broker refused; its text is the wrapped error's.
type declareError struct{ err error }

func (e *declareError) Error() string { return e.err.Error() }
func (e *declareError) Unwrap() error { return e.err }

// refusalMessage is the message of the error logged when the broker
// refuses a reconnect, saying what to change on the broker.
func refusalMessage(err error) string {
	var de *declareError
	var ae *amqp091.Error
	if errors.As(err, &de) && errors.As(err, &ae) {
		switch ae.Code {
		case amqp091.PreconditionFailed:
			return "amqp: the broker refuses the source's declaration of its topology: an exchange or queue of the Config " +
				"exists there with other properties (the error names it and the argument, e.g. made internal or " +
				"declared with other arguments); retrying until they agree: declare it on the broker as the Config " +
				"does (a queue deleted to be declared again loses its messages), or change the Config and restart the source"
		case amqp091.NotFound:
			return "amqp: the broker refuses the source's topology: an exchange or queue the source binds or checks " +
				"(Config.Passive) is missing there (the error names it); retrying until it is declared on the broker again"
		case amqp091.ResourceLocked:
			return "amqp: the broker refuses the source's queue: a queue of that name is exclusive to another connection " +
				"(RESOURCE_LOCKED), which alone may use it, and is deleted when that connection closes; retrying until it is " +
				"gone: close that connection or give one of the queues another name"
		}
	}
	return "amqp: the broker refuses the source's credentials, permissions, TLS settings or topology; retrying until that is fixed on the broker or the source is closed"
}

// session is the consuming connection with its channel.
type session struct {
	conn       *amqp091.Connection
	ch         *amqp091.Channel
	acker      *acker
	deliveries <-chan amqp091.Delivery
	// ctx is done when the connection or the consuming channel closed; its
	// cause says why.
	ctx    context.Context
	cancel context.CancelCauseFunc
	// started is when the session was established, and delivered is set
	// once Receive returned one of its deliveries: a session that dies
	// young without either flapped (see Source.flaps).
	started   time.Time
	delivered atomic.Bool
	// streamUnchecked: Config.Passive, and the broker would not say
	// whether the queue is a stream (checkPassiveQueue); a delivery that
	// comes from a stream then ends the source (fromStream).
	streamUnchecked bool
}

// connect makes one attempt to open a session: dial, open the consuming
// channel, declare the topology, apply QoS and consume.
func (s *Source) connect() (*session, error) {
	conn, err := dialConsuming(&s.cfg, s.cfg.ConnectionName)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*session, error) {
		_ = conn.CloseDeadline(time.Now().Add(time.Second))
		return nil, err
	}
	if s.cfg.QueueType == QueueQuorum && !s.cfg.Passive {
		version, _ := conn.Properties["version"].(string)
		if err := checkDeliveryLimit("Config.QueueArgs", s.cfg.QueueArgs, version); err != nil {
			return fail(err)
		}
		if err := checkDeliveryLimit("Config.DeadLetter.QueueArgs", s.cfg.DeadLetter.QueueArgs, version); err != nil {
			return fail(err)
		}
	}
	ch, err := conn.Channel()
	if err != nil {
		return fail(fmt.Errorf("amqp: open channel: %w", err))
	}
	if err := s.declare(ch); err != nil {
		return fail(err)
	}
	var streamUnchecked bool
	if s.cfg.Passive {
		if streamUnchecked, err = s.checkPassiveQueue(conn); err != nil {
			return fail(err)
		}
	}
	if err := ch.Qos(s.cfg.Prefetch, 0, false); err != nil {
		return fail(fmt.Errorf("amqp: set Config.Prefetch %d: %w", s.cfg.Prefetch, err))
	}
	s.mu.Lock()
	first := !s.connected
	s.mu.Unlock()
	if first {
		// Before consuming: messages delivered to a source Open then
		// refuses would come back marked redelivered.
		if err := s.checkDeadLetterWrite(); err != nil {
			return fail(err)
		}
	}
	connClosed := conn.NotifyClose(make(chan *amqp091.Error, 1))
	chClosed := ch.NotifyClose(make(chan *amqp091.Error, 1))
	select {
	case <-s.closeCh:
		// Given up and closed meanwhile: a consumer nobody reads would
		// hold messages unacked until the session is closed.
		return fail(consumer.ErrSourceClosed)
	default:
	}
	deliveries, err := ch.Consume(s.cfg.Queue, s.cfg.ConsumerTag, false, false, false, false, nil)
	if err != nil {
		return fail(fmt.Errorf("amqp: consume queue %q: %w", s.cfg.Queue, err))
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	sess := &session{conn: conn, ch: ch, deliveries: deliveries, ctx: ctx, cancel: cancel, acker: newAcker(ch, s.cfg.Prefetch),
		started: time.Now(), streamUnchecked: streamUnchecked}
	go sess.watch(connClosed, chClosed)
	return sess, nil
}

// dial opens a connection to the broker of cfg, named name in the
// broker's connection list, with amqp091's default frame size (128 KiB,
// RabbitMQ's default frame_max, or the broker's if lower): what the
// dead-letter copies are shaped to, so that a client left at that default
// (once dlq) reads them whatever the broker's frame_max.
func dial(cfg *Config, name string) (*amqp091.Connection, error) {
	return dialFrames(cfg, name, 0, nil)
}

// dialClocked is dial, and records in wrote (Unix nanoseconds) when the
// connection last wrote to its socket: how the dead-letter publisher tells
// a copy the broker takes slowly (a slow link) from one it takes nothing
// of (blocked under an alarm).
func dialClocked(cfg *Config, name string, wrote *atomic.Int64) (*amqp091.Connection, error) {
	return dialFrames(cfg, name, 0, wrote)
}

// dialConsuming opens the consuming connection. It takes the broker's
// frame_max as its frame size: a content header frame is never split, so
// a message whose properties a publisher fitted in a frame_max raised above
// amqp091's default would be refused by a client capped at that default,
// the connection closed, and the message delivered first again on every
// new one, holding the queue.
func dialConsuming(cfg *Config, name string) (*amqp091.Connection, error) {
	return dialFrames(cfg, name, amqp091.FrameSizeUnlimited, nil)
}

// dialFrames opens a connection named name with frameSize as amqp091's
// Config.FrameSize, recording its writes in wrote unless nil.
func dialFrames(cfg *Config, name string, frameSize int, wrote *atomic.Int64) (*amqp091.Connection, error) {
	props := amqp091.NewConnectionProperties()
	props.SetClientConnectionName(name)
	dialer := amqp091.DefaultDial(cfg.DialTimeout)
	if wrote != nil {
		dialer = writeclock.Dial(dialer, wrote)
	}
	conn, err := amqp091.DialConfig(cfg.URL, amqp091.Config{
		Heartbeat: cfg.Heartbeat,
		FrameSize: frameSize,
		// A copy: amqp091 writes the URL's host into an empty
		// ServerName of the config it is given, which would then name
		// this broker for every other use of the caller's config.
		TLSClientConfig: cfg.TLSConfig.Clone(),
		Properties:      props,
		Dial:            dialer,
	})
	if err != nil {
		if tlsRefused(err) {
			return nil, fmt.Errorf("amqp: dial %s: TLS handshake failed (Config.TLSConfig, or an amqps URL at a port that speaks plain AMQP): %w",
				redactURL(cfg.URL), redactErr(err, cfg.URL))
		}
		return nil, fmt.Errorf("amqp: dial %s: %w", redactURL(cfg.URL), redactErr(err, cfg.URL))
	}
	return conn, nil
}

// tlsRefused reports whether err is a TLS handshake that failed for what
// the source and the broker are configured with, which fails again on
// every attempt. amqp091 returns the handshake's own error, except for an
// alert the broker sends once the handshake is over (TLS 1.3 refuses a
// missing client certificate so), which it reports as a frame error
// carrying only the read error's text.
func tlsRefused(err error) bool {
	if tlsfail.Refused(err) {
		return true
	}
	var ae *amqp091.Error
	return errors.As(err, &ae) && !ae.Server && ae.Code == amqp091.FrameError && strings.HasPrefix(ae.Reason, "remote error: tls: ")
}

// watch cancels the session's context when its connection or consuming
// channel closes, and closes the connection when only the channel did.
func (sess *session) watch(connClosed, chClosed <-chan *amqp091.Error) {
	select {
	case e := <-connClosed:
		sess.cancel(closeCause("connection", e))
	case e := <-chClosed:
		sess.cancel(closeCause("channel", e))
	case <-sess.ctx.Done():
	}
	_ = sess.conn.CloseDeadline(time.Now().Add(2 * time.Second))
}

// endCause says why the session's delivery channel closed: the closing of
// the channel or connection, or else a consumer cancelled by the broker
// (its queue was deleted).
func (sess *session) endCause() error {
	if sess.ch.IsClosed() {
		// The watcher has the broker's reason, or gets it at once.
		t := time.NewTimer(time.Second)
		defer t.Stop()
		select {
		case <-sess.ctx.Done():
			return context.Cause(sess.ctx)
		case <-t.C:
			return errors.New("amqp: channel closed")
		}
	}
	return errors.New("amqp: the broker cancelled the consumer (queue deleted?)")
}

// closeCause is the cause the session's deliveries' contexts end with:
// consumer.ErrDeliveryTimedOut too when the broker closed the channel for a
// delivery left unacked past its consumer_timeout.
func closeCause(what string, e *amqp091.Error) error {
	switch {
	case e == nil:
		return fmt.Errorf("amqp: %s closed", what)
	case consumerTimedOut(e):
		return fmt.Errorf("amqp: %s closed: %w (%w)", what, e, consumer.ErrDeliveryTimedOut)
	}
	return fmt.Errorf("amqp: %s closed: %w", what, e)
}

// close sends the pending acks, cancels the session's context with cause
// and closes the connection; unacked deliveries go back to the queue.
func (sess *session) close(cause error) error {
	sess.acker.stop()
	sess.cancel(cause)
	err := sess.conn.CloseDeadline(time.Now().Add(5 * time.Second))
	if err != nil && !errors.Is(err, amqp091.ErrClosed) {
		return fmt.Errorf("amqp: close connection: %w", err)
	}
	return nil
}

// declare declares (or checks, in passive mode) the exchanges, the queue,
// its bindings and the dead-letter destination.
func (s *Source) declare(ch *amqp091.Channel) error {
	cfg := &s.cfg
	for _, e := range cfg.Exchanges {
		kind := e.Kind
		if kind == "" {
			kind = DefaultExchangeKind
		}
		if err := declareExchange(ch, cfg.Passive, e.Name, kind, e.Args); err != nil {
			return err
		}
	}
	if err := declareQueue(ch, cfg.Passive, cfg.Queue, queueArgs(cfg.QueueType, cfg.QueueArgs)); err != nil {
		return err
	}
	if !cfg.Passive {
		for _, b := range cfg.Bindings {
			if err := ch.QueueBind(cfg.Queue, b.RoutingKey, b.Exchange, false, b.Args); err != nil {
				return &declareError{fmt.Errorf("amqp: bind queue %q to exchange %q with key %q: %w", cfg.Queue, b.Exchange, b.RoutingKey, err)}
			}
		}
	}
	return declareDeadLetter(ch, cfg)
}

// declareDeadLetter declares (or checks, in passive mode) the dead-letter
// exchange, if named, and the dead-letter queue with its binding, if any.
func declareDeadLetter(ch *amqp091.Channel, cfg *Config) error {
	dl := cfg.DeadLetter
	if dl.Exchange != "" {
		if err := declareExchange(ch, cfg.Passive, dl.Exchange, dl.ExchangeKind, nil); err != nil {
			return err
		}
	}
	if dl.Queue != "" {
		if err := declareQueue(ch, cfg.Passive, dl.Queue, queueArgs(cfg.QueueType, dl.QueueArgs)); err != nil {
			return err
		}
		if dl.Exchange != "" && !cfg.Passive {
			if err := ch.QueueBind(dl.Queue, dl.RoutingKey, dl.Exchange, false, nil); err != nil {
				return &declareError{fmt.Errorf("amqp: bind dead-letter queue %q to exchange %q with key %q: %w", dl.Queue, dl.Exchange, dl.RoutingKey, err)}
			}
		}
	}
	return nil
}

// declareExchange declares a durable exchange, or checks it in passive
// mode.
func declareExchange(ch *amqp091.Channel, passive bool, name, kind string, args amqp091.Table) error {
	var err error
	if passive {
		err = ch.ExchangeDeclarePassive(name, kind, true, false, false, false, args)
	} else {
		err = ch.ExchangeDeclare(name, kind, true, false, false, false, args)
	}
	if err != nil {
		return &declareError{fmt.Errorf("amqp: %s exchange %q: %w", verb(passive), name, err)}
	}
	return nil
}

// declareQueue declares a durable queue, or checks it in passive mode.
func declareQueue(ch *amqp091.Channel, passive bool, name string, args amqp091.Table) error {
	var err error
	if passive {
		_, err = ch.QueueDeclarePassive(name, true, false, false, false, nil)
	} else {
		_, err = ch.QueueDeclare(name, true, false, false, false, args)
	}
	if err != nil {
		return &declareError{fmt.Errorf("amqp: %s queue %q: %w", verb(passive), name, err)}
	}
	return nil
}

func verb(passive bool) string {
	if passive {
		return "check"
	}
	return "declare"
}

// queueArgs returns args plus x-queue-type for quorum queues. Classic
// queues get no x-queue-type, so that queues declared without one by other
// tools stay equivalent.
func queueArgs(t QueueType, args amqp091.Table) amqp091.Table {
	out := amqp091.Table{}
	for k, v := range args {
		out[k] = v
	}
	if t == QueueQuorum {
		out["x-queue-type"] = string(QueueQuorum)
	}
	return out
}
