package dlq

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/cmd/once/internal/cut"
)

// AMQPConfig configures a RabbitMQ dead-letter queue.
type AMQPConfig struct {
	// URL of the broker, "amqp://user:password@host:port/vhost" or
	// "amqps://...". Required. The password never appears in errors.
	URL string
	// TLSConfig is used for amqps URLs; nil means the system roots. Set
	// with an amqp:// URL, NewAMQP refuses it (the connection would not
	// use TLS).
	TLSConfig *tls.Config
	// Queue is the dead-letter queue ("orders.dlq"). Required.
	Queue string
	// IdleTimeout bounds the wait for the next message while fewer have
	// arrived than the queue held at the start (another client holds some
	// unacked), and the end of a read, which puts the messages back.
	// Default 2s.
	IdleTimeout time.Duration
	// MaxHold bounds how long a replay holds the queue's messages
	// unacked: one that lasts longer (slowed by ReplayOptions.Rate, or
	// long) puts them back and takes them again before then, so that the
	// broker's consumer_timeout (30 minutes by default), which closes the
	// channel of a message unacked longer, never ends it. Keep it below
	// the broker's consumer_timeout; each time the messages are put back
	// adds one to their x-delivery-count on a quorum queue. Default 10
	// minutes.
	MaxHold time.Duration
}

// AMQPQueue is a RabbitMQ dead-letter queue. Build it with NewAMQP.
type AMQPQueue struct {
	cfg AMQPConfig
}

// NewAMQP validates cfg and returns the queue's Queue. It connects to
// nothing until used.
func NewAMQP(cfg AMQPConfig) (*AMQPQueue, error) {
	if cfg.URL == "" {
		return nil, errors.New("dlq: AMQPConfig.URL is empty")
	}
	u, err := amqp091.ParseURI(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("dlq: AMQPConfig.URL %s: does not parse", redact(cfg.URL))
	}
	if cfg.TLSConfig != nil && u.Scheme != "amqps" {
		// amqp091 would ignore it and connect without TLS.
		return nil, fmt.Errorf("dlq: AMQPConfig.TLSConfig is set but AMQPConfig.URL %s is not an amqps URL: the connection would not use TLS", redact(cfg.URL))
	}
	if cfg.Queue == "" {
		return nil, errors.New("dlq: AMQPConfig.Queue is empty")
	}
	if cfg.IdleTimeout < 0 {
		return nil, fmt.Errorf("dlq: AMQPConfig.IdleTimeout %v is negative", cfg.IdleTimeout)
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = 2 * time.Second
	}
	if cfg.MaxHold < 0 {
		return nil, fmt.Errorf("dlq: AMQPConfig.MaxHold %v is negative", cfg.MaxHold)
	}
	if cfg.MaxHold == 0 {
		cfg.MaxHold = 10 * time.Minute
	}
	return &AMQPQueue{cfg: cfg}, nil
}

// Name returns "rabbitmq queue <Queue>".
func (q *AMQPQueue) Name() string { return "rabbitmq queue " + q.cfg.Queue }

// Close releases nothing: every call has its own connection.
func (q *AMQPQueue) Close() error { return nil }

func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparsable URL>"
	}
	return u.Redacted()
}

// dial connects as amqp091.Dial and DialTLS do, through a cutter that
// closes the connection when ctx ends before dial returns.
func (q *AMQPQueue) dial(ctx context.Context) (*amqp091.Connection, *cut.Cutter, error) {
	conn, cutter, err := cut.AMQP(ctx, q.cfg.URL, q.cfg.TLSConfig)
	if err != nil {
		if ctx.Err() != nil {
			return nil, nil, ctx.Err()
		}
		return nil, nil, fmt.Errorf("dlq: connect to %s: %w", redact(q.cfg.URL), scrub(err, q.cfg.URL))
	}
	return conn, cutter, nil
}

// scrub removes the URL's password from err's text.
func scrub(err error, raw string) error {
	u, perr := url.Parse(raw)
	if perr != nil || u.User == nil {
		return err
	}
	if pw, ok := u.User.Password(); ok && pw != "" {
		if s := err.Error(); strings.Contains(s, pw) {
			return errors.New(strings.ReplaceAll(s, pw, "xxxxx"))
		}
	}
	return err
}

// held is a read of the queue: the deliveries taken, unacked, in order.
// Closing its channel puts every one not acked back at its position.
type held struct {
	q     *AMQPQueue
	conn  *amqp091.Connection
	cut   *cut.Cutter
	ch    *amqp091.Channel
	pub   *amqp091.Channel // a replay's, nil until it opens it
	recs  []*Record
	acked int
}

// close puts the messages not acked back and waits, up to IdleTimeout,
// until the queue counts them as ready again: a quorum queue returns them
// asynchronously, and a read that started before would miss them. It
// takes IdleTimeout at most: a broker that does not answer has the
// connection closed under it, which puts the messages back as well.
func (h *held) close() {
	deadline := time.Now().Add(h.q.cfg.IdleTimeout)
	bound := time.AfterFunc(h.q.cfg.IdleTimeout, h.cut.Cut)
	defer bound.Stop()
	defer h.conn.Close()
	if h.pub != nil {
		_ = h.pub.Close()
	}
	_ = h.ch.Close()
	back := len(h.recs) - h.acked
	if back <= 0 {
		return
	}
	ch, err := h.conn.Channel()
	if err != nil {
		return
	}
	defer ch.Close()
	for time.Now().Before(deadline) {
		st, err := ch.QueueDeclarePassive(h.q.cfg.Queue, false, false, false, false, nil)
		if err != nil || st.Messages >= back {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// hold takes the messages the queue holds when it starts, unacked and in
// order, and converts each to a Record. When ctx ends, it returns at once:
// the connection is closed under a call that waits on the broker
// (amqp091's calls, but for the wait for a confirm, do not watch a
// context).
func (q *AMQPQueue) hold(ctx context.Context) (*held, error) {
	conn, cutter, err := q.dial(ctx)
	if err != nil {
		return nil, err
	}
	var ch *amqp091.Channel
	if err := cut.Guard(ctx, cutter, func() error { ch, err = conn.Channel(); return err }); err != nil {
		cutter.Cut()
		return nil, orCtx(ctx, fmt.Errorf("dlq: open channel: %w", err))
	}
	h := &held{q: q, conn: conn, cut: cutter, ch: ch}
	var st amqp091.Queue
	if err := cut.Guard(ctx, cutter, func() error {
		st, err = ch.QueueDeclarePassive(q.cfg.Queue, false, false, false, false, nil)
		return err
	}); err != nil {
		h.close()
		return nil, orCtx(ctx, fmt.Errorf("dlq: queue %s: %w", q.cfg.Queue, err))
	}
	if st.Messages == 0 {
		return h, nil
	}
	var deliveries <-chan amqp091.Delivery
	if err := cut.Guard(ctx, cutter, func() error {
		deliveries, err = ch.ConsumeWithContext(ctx, q.cfg.Queue, "", false, false, false, false, nil)
		return err
	}); err != nil {
		h.close()
		return nil, orCtx(ctx, fmt.Errorf("dlq: read queue %s: %w", q.cfg.Queue, err))
	}
	idle := time.NewTimer(q.cfg.IdleTimeout)
	defer idle.Stop()
	for len(h.recs) < st.Messages {
		select {
		case d, ok := <-deliveries:
			if !ok {
				h.close()
				return nil, orCtx(ctx, fmt.Errorf("dlq: read queue %s: the channel closed", q.cfg.Queue))
			}
			h.recs = append(h.recs, amqpRecord(q.cfg.Queue, len(h.recs)+1, &d))
			idle.Reset(q.cfg.IdleTimeout)
		case <-idle.C:
			// Some of the messages counted at the start are held by
			// another client: what arrived is what can be read now.
			return h, nil
		case <-ctx.Done():
			h.close()
			return nil, ctx.Err()
		}
	}
	return h, nil
}

// Browse reads the messages the queue holds when it starts without acking
// any: it takes them on a channel of its own and closes the channel, which
// puts them back at their positions. A message another client holds
// unacked is not seen. When ctx ends it returns at once, or within
// IdleTimeout while it puts the messages back.
func (q *AMQPQueue) Browse(ctx context.Context, fn func(*Record) error) error {
	h, err := q.hold(ctx)
	if err != nil {
		return err
	}
	defer h.close()
	for _, r := range h.recs {
		if err := fn(r); err != nil {
			return err
		}
	}
	return nil
}

// Replay publishes each selected message to its original exchange with
// its original routing key (mandatory, with publisher confirms) and, unless
// opts.Keep, acks it in the dead-letter queue once the broker confirmed the
// redrive. The messages not selected, or not replayed, go back to their
// positions. A crash between the confirm and the ack leaves the message in
// the queue: replaying it again is deduplicated. When ctx ends it stops as
// Browse does; a message whose redrive the broker confirmed is acked
// first, and counted.
//
// The queue's messages are held unacked for AMQPConfig.MaxHold at most:
// a replay that lasts longer (slowed by opts.Rate, or long) puts them back
// before then and takes them again, so that the broker's consumer_timeout
// never closes its channel. A selected message that is not in the queue
// when it is taken again (removed, or held by another client meanwhile)
// is reported as skipped.
func (q *AMQPQueue) Replay(ctx context.Context, f Filter, opts ReplayOptions) (Report, error) {
	if err := opts.validate(); err != nil {
		return Report{}, err
	}
	h, err := q.hold(ctx)
	if err != nil {
		return Report{}, err
	}
	var sel []*Record
	for _, r := range h.recs {
		if f.Match(r) {
			sel = append(sel, r)
		}
	}
	if opts.DryRun || len(sel) == 0 {
		defer h.close()
		return replayLoop(ctx, sel, opts, nil)
	}
	rd := &redriver{q: q, opts: opts}
	defer rd.release()
	if err := rd.take(ctx, h); err != nil {
		return Report{}, err
	}
	return replayLoop(ctx, sel, opts, func(r *Record, redrive []Header) (string, error) {
		if rd.h == nil || time.Since(rd.taken) >= q.cfg.MaxHold {
			// Held too long for the next publish: put every message
			// back and take them again.
			rd.release()
			h, err := q.hold(ctx)
			if err != nil {
				return "", err
			}
			if err := rd.take(ctx, h); err != nil {
				return "", err
			}
		}
		d := rd.delivery(r)
		if d == nil {
			return "", errGone
		}
		dest, err := rd.publish(ctx, r, d, redrive)
		if err == nil && rd.every >= q.cfg.MaxHold-time.Since(rd.taken) {
			// The wait for the next publish would outlast the hold:
			// the messages wait in the queue instead.
			rd.release()
		}
		return dest, err
	})
}

// redriver is a replay's hold of the queue and its publishing channel,
// replaced by a new one when the hold has lasted MaxHold.
type redriver struct {
	q    *AMQPQueue
	opts ReplayOptions
	// every is the interval between publishes that opts.Rate sets.
	every time.Duration
	h     *held // nil once released
	taken time.Time
	// byRef has the messages of h not yet redriven, by ref, in order.
	byRef   map[string][]*Record
	returns chan amqp091.Return
	closed  chan *amqp091.Error
}

// take makes h, just taken, the hold, and opens its publishing channel
// in confirm mode. On an error it releases h.
func (rd *redriver) take(ctx context.Context, h *held) error {
	rd.h, rd.taken, rd.byRef = h, time.Now(), make(map[string][]*Record, len(h.recs))
	for _, r := range h.recs {
		rd.byRef[r.Ref] = append(rd.byRef[r.Ref], r)
	}
	rd.every = paceInterval(rd.opts.Rate)
	var pub *amqp091.Channel
	var err error
	if err := cut.Guard(ctx, h.cut, func() error { pub, err = h.conn.Channel(); return err }); err != nil {
		rd.release()
		return orCtx(ctx, fmt.Errorf("dlq: open channel: %w", err))
	}
	h.pub = pub // closed with h
	if err := cut.Guard(ctx, h.cut, func() error { return pub.Confirm(false) }); err != nil {
		rd.release()
		return orCtx(ctx, fmt.Errorf("dlq: confirm mode: %w", err))
	}
	rd.returns = pub.NotifyReturn(make(chan amqp091.Return, 1))
	rd.closed = pub.NotifyClose(make(chan *amqp091.Error, 1))
	return nil
}

// release puts the messages of the hold not acked back, if it holds any.
func (rd *redriver) release() {
	if rd.h != nil {
		rd.h.close()
		rd.h = nil
	}
}

// delivery returns the delivery of the hold that carries r: the first
// message not yet redriven with r's ref, r's own or, in a hold taken since
// r was read, its copy (messages alike to the byte share a ref, and
// either redrives the same). It returns nil when the hold has none.
func (rd *redriver) delivery(r *Record) *amqp091.Delivery {
	recs := rd.byRef[r.Ref]
	if len(recs) == 0 {
		return nil
	}
	rd.byRef[r.Ref] = recs[1:]
	return recs[0].raw.(*amqp091.Delivery)
}

// publish redrives d, the delivery of r, waits for the broker's confirm
// and, unless opts.Keep, acks d.
func (rd *redriver) publish(ctx context.Context, r *Record, d *amqp091.Delivery, redrive []Header) (string, error) {
	h, pub := rd.h, rd.h.pub
	ex, rk := r.Header(amqp.HeaderOriginalExchange), r.Header(amqp.HeaderOriginalRoutingKey)
	// A write blocks while the broker pushes back (a memory alarm):
	// guarded. Waiting for the confirm watches ctx, and the ack that
	// follows a confirm is not cut short.
	var conf *amqp091.DeferredConfirmation
	if err := cut.Guard(ctx, h.cut, func() error {
		var err error
		conf, err = pub.PublishWithDeferredConfirmWithContext(ctx, ex, rk, true, false, amqpRedrive(d, redrive, rd.q.user()))
		return err
	}); err != nil {
		return "", err
	}
	acked, err := conf.WaitContext(ctx)
	if err != nil {
		select {
		case <-conf.Done(): // confirmed as ctx ended: it counts
			acked = conf.Acked()
		default:
			return "", err
		}
	}
	if pub.IsClosed() {
		// A missing exchange closes the channel (404).
		if cerr := <-rd.closed; cerr != nil {
			return "", fmt.Errorf("the broker closed the channel: %w", cerr)
		}
		return "", errors.New("the channel closed")
	}
	select {
	case ret := <-rd.returns:
		return "", fmt.Errorf("unroutable (%s): no queue is bound to exchange %q with routing key %q", ret.ReplyText, ex, rk)
	default:
	}
	if !acked {
		return "", errors.New("the broker nacked the publish")
	}
	if !rd.opts.Keep {
		if err := d.Ack(false); err != nil {
			return "", fmt.Errorf("published, but the dead letter was not removed: %w", err)
		}
		h.acked++
	}
	return r.Destination(), nil
}

// amqpRedrive builds the redrive of d: its properties, body and original
// headers (the CC header the copy kept aside restored; the broker's
// x-delivery-count and x-acquired-count left out: they counted deliveries
// in another queue, or of the dead letter itself, and carried back would
// make the redriven message look redelivered, to the consumer, which reads
// x-delivery-count, and to others that read either), then the redrive
// headers.
//
// The properties the copy could not carry come back from the headers it
// kept them in: the expiration (once-original-expiration), which counts
// from when a message enters a queue, so that the redriven message has the
// time its publisher gave the original, from the redrive on; and the
// user-id (once-original-user-id) when user, the name the replay
// authenticates with, is that user, the only one the broker lets publish
// it. The delivery mode stays persistent: the dead letter is removed once
// the redrive is confirmed, and a transient redrive would be lost with a
// restart of the broker.
func amqpRedrive(d *amqp091.Delivery, redrive []Header, user string) amqp091.Publishing {
	h := make(amqp091.Table, len(d.Headers)+len(redrive))
	for k, v := range d.Headers {
		if !diagnosticHeaders[k] && !brokerCount(k) {
			h[k] = v
		}
	}
	if cc, ok := d.Headers[amqp.HeaderOriginalCC]; ok {
		h["CC"] = cc
	}
	for _, rh := range redrive {
		h[rh.Key] = rh.Value
	}
	p := amqp091.Publishing{
		Headers:         h,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    amqp091.Persistent,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
	if exp, ok := d.Headers[amqp.HeaderOriginalExpiration].(string); ok {
		p.Expiration = exp
	}
	if uid, ok := d.Headers[amqp.HeaderOriginalUserID].(string); ok && uid != "" && uid == user {
		p.UserId = uid
	}
	return p
}

// user returns the user name the queue's connections authenticate with
// (the URL's, PLAIN), or "" when it is not known: another SASL mechanism
// (EXTERNAL takes it from the client certificate).
func (q *AMQPQueue) user() string {
	u, err := amqp091.ParseURI(q.cfg.URL)
	if err != nil {
		return ""
	}
	for _, m := range u.AuthMechanism {
		if !strings.EqualFold(m, "plain") {
			return ""
		}
	}
	return u.Username
}

func amqpRecord(queue string, pos int, d *amqp091.Delivery) *Record {
	headers := make([]Header, 0, len(d.Headers))
	for k, v := range d.Headers {
		headers = append(headers, Header{k, amqp.HeaderString(v)})
	}
	slices.SortFunc(headers, func(a, b Header) int {
		switch {
		case a.Key < b.Key:
			return -1
		case a.Key > b.Key:
			return 1
		}
		return 0
	})
	r := &Record{
		Queue:     queue,
		Position:  pos,
		Partition: -1,
		Offset:    -1,
		Value:     d.Body,
		Headers:   headers,
		Properties: &Properties{
			MessageID: d.MessageId, Type: d.Type, ContentType: d.ContentType,
			ContentEncoding: d.ContentEncoding, CorrelationID: d.CorrelationId,
			ReplyTo: d.ReplyTo, AppID: d.AppId, Priority: d.Priority, Timestamp: d.Timestamp,
		},
		raw: d,
	}
	r.Ref = amqpRef(d.Body, headers)
	r.Timestamp = r.FailedAt()
	return r
}
