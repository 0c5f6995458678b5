package amqp

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/url"
	"strconv"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/metric"
)

// QueueType is the x-queue-type of a declared queue.
type QueueType string

// The queue types the source declares.
const (
	// QueueClassic declares a durable classic queue (the default).
	QueueClassic QueueType = "classic"
	// QueueQuorum declares a quorum queue (replicated, durable). RabbitMQ
	// counts deliveries of quorum queue messages in the x-delivery-count
	// header, which the source reports as Message.DeliveryCount on a
	// redelivery.
	QueueQuorum QueueType = "quorum"
)

// Default values of Config fields left zero.
const (
	DefaultPrefetch            = 2048
	DefaultConfirmTimeout      = 10 * time.Second
	DefaultDialTimeout         = 10 * time.Second
	DefaultHeartbeat           = 10 * time.Second
	DefaultReconnectMinBackoff = 100 * time.Millisecond
	DefaultReconnectMaxBackoff = 10 * time.Second
	DefaultExchangeKind        = "direct"
	// DeadLetterQueueSuffix is appended to Config.Queue to name the default
	// dead-letter queue.
	DeadLetterQueueSuffix = ".dlq"
)

// Exchange is an exchange the source declares (durable, not auto-deleted)
// before it binds its queue.
type Exchange struct {
	// Name of the exchange. Required; the default exchange "" cannot be
	// declared.
	Name string
	// Kind is "direct", "fanout", "topic", "headers" or a plugin's kind.
	// Default "direct".
	Kind string
	// Args are the exchange's declare arguments (e.g. alternate-exchange).
	Args amqp091.Table
}

// Binding binds the source's queue to an exchange.
type Binding struct {
	// Exchange to bind to. Required: every queue is already bound to the
	// default exchange under its own name.
	Exchange string
	// RoutingKey (binding key) of the binding; may be empty (fanout) or a
	// pattern (topic).
	RoutingKey string
	// Args of the binding (headers exchanges match on them).
	Args amqp091.Table
}

// DeadLetterConfig says where Delivery.DeadLetter publishes copies of
// poison messages. The zero value publishes to the default exchange with
// routing key "<Queue>.dlq" and declares that queue.
type DeadLetterConfig struct {
	// Exchange the copies are published to. Default "": the default
	// exchange, which routes by queue name. A non-empty Exchange is
	// declared (durable) with ExchangeKind unless Config.Passive is set.
	// One of Config.Bindings to it that routes RoutingKey (a direct
	// exchange's equal key, any fanout or headers binding, a matching topic
	// pattern) is refused: the copies would go back into Config.Queue.
	Exchange string
	// ExchangeKind is the kind used to declare Exchange. Default: the Kind
	// of Exchange in Config.Exchanges when it is one of them (another kind
	// is refused), else "direct".
	ExchangeKind string
	// RoutingKey of the copies. Default: Queue.
	RoutingKey string
	// Queue is the dead-letter queue declared (durable, of the same
	// QueueType as the source's queue) and, when Exchange is not "", bound
	// to Exchange with RoutingKey. Default "<Config.Queue>.dlq".
	Queue string
	// QueueArgs are extra declare arguments of Queue, as Config.QueueArgs
	// are the source queue's (x-queue-type comes from Config.QueueType; one
	// here that contradicts it is refused).
	// On RabbitMQ 4 and later a quorum queue drops a message delivered 20
	// times unless declared with "x-delivery-limit": -1 (RabbitMQ 3 takes
	// -1 for 0, so set it on 4 only: Open refuses a limit below 1 on
	// RabbitMQ 3), and each read of the dead letters by once dlq or the
	// console counts as a delivery. Default none.
	QueueArgs amqp091.Table
	// NoQueue: declare no dead-letter queue; something else routes the
	// copies from Exchange. Queue must then be empty. Publishes that no queue receives fail (they are
	// published mandatory), so the consumer keeps retrying them instead of
	// losing the message; each such failure is logged at level Error.
	NoQueue bool
}

// Config configures a Source. URL and Queue are required; every other field
// has a documented default.
type Config struct {
	// URL of the broker, "amqp://user:password@host:port/vhost" or
	// "amqps://..." for TLS. Required. The password never appears in errors
	// or logs.
	URL string
	// TLSConfig is used for amqps URLs (client certificates, root CAs). Nil:
	// the system roots with the URL's host as server name, as when its
	// ServerName is empty. The source dials with a copy and never
	// modifies it, so one config may serve several sources.
	TLSConfig *tls.Config
	// DialTimeout bounds the TCP connect plus the TLS and AMQP handshakes.
	// Default 10s; at least a millisecond (a unit mistake: 10 is 10 ns).
	DialTimeout time.Duration
	// Heartbeat is the AMQP heartbeat interval: a dead peer is detected
	// after about two intervals without traffic. Default 10s; at least 1s
	// (the protocol counts whole seconds). A heartbeat parameter in URL
	// takes its place (amqp091 reads it); heartbeat=0 is refused.
	Heartbeat time.Duration
	// ConnectionName is shown in the RabbitMQ management UI and
	// rabbitmqctl list_connections. Default "once <Queue>". The
	// dead-letter connection is named "<ConnectionName> (dead letters)".
	ConnectionName string

	// Queue the source consumes from. Required.
	Queue string
	// QueueType of the declared queue and dead-letter queue. Default
	// QueueClassic. Both are declared durable and not auto-deleted.
	QueueType QueueType
	// QueueArgs are extra declare arguments of the queue (x-max-length,
	// x-message-ttl, ...). x-queue-type is set from QueueType. On RabbitMQ 3
	// an x-delivery-limit below 1 of a quorum queue is refused: RabbitMQ 3
	// takes it for 0 and drops each message at its first redelivery
	// (RabbitMQ 4 takes -1 for no limit; docs/amqp.md, Pitfalls). A
	// positive x-delivery-limit of a quorum queue without
	// x-dead-letter-exchange (or none on RabbitMQ 4, which then limits
	// deliveries to 20) drops a message returned to the queue more often:
	// Open logs a warning, and does not refuse it, since a policy may give
	// the queue a dead-letter exchange. The same holds for
	// DeadLetter.QueueArgs.
	QueueArgs amqp091.Table
	// Exchanges are declared before the bindings.
	Exchanges []Exchange
	// Bindings of the queue.
	Bindings []Binding
	// Passive: declare nothing, only check that the queue, the exchanges,
	// the dead-letter exchange and the dead-letter queue exist (AMQP has no
	// passive binding check, so Bindings are not checked). For deployments
	// where topology is owned elsewhere and the user may lack configure
	// permission. A missing entity makes Open fail. A stream queue
	// (x-queue-type "stream", which never delivers a message again) is
	// refused: Open asks the broker and fails with a configuration error;
	// where the user may not configure the queue, so that the broker will
	// not tell, Receive returns that error at the first delivery that
	// comes from a stream, before the consumer handles it. A queue that is
	// not durable, or is auto-delete, is consumed with a warning: the
	// broker loses it, with its messages, at a restart or when its last
	// consumer goes.
	Passive bool

	// Prefetch is the channel's QoS prefetch count: how many unacked
	// deliveries the broker hands the source at once. Defaults to 2048
	// (DefaultPrefetch). Keep it above twice the consumer's
	// Config.Concurrency × Config.Batch.Size (the consumer's defaults:
	// 100 per batch, a transaction per pool connection): workers starve
	// below it, batches form only from deliveries already received, and
	// the acks of a batch committed before an earlier one are held back
	// (so that one frame settles both) only while they fill less than half
	// the prefetch. A larger prefetch holds more messages in memory and
	// redelivers more after a lost connection (each then skipped as a
	// duplicate). Measured with RabbitMQ 3.10 on 2 cores, a consumer of
	// batches of 100 at 8 transactions ran 1.2-1.5x faster at 2048 than at
	// 512 (docs/performance.md). Prefetch is applied again after every
	// reconnect.
	Prefetch int
	// ConsumerTag of the subscription. Default: a unique tag amqp091
	// generates.
	ConsumerTag string
	// Ordered puts every message of the queue on one stream
	// (Message.Stream is the queue name): the consumer then handles them
	// one after another in the order the broker delivers them, in batches
	// of up to consumer.Config.Batch.Size per transaction, and acks them in
	// that order. Default false: no order, deliveries are handled
	// concurrently (consumer.Config.Concurrency). Ordered trades
	// concurrency for order and batching, which is faster when the handler
	// is short. The order is the queue's only with one consumer on it
	// (e.g. QueueArgs "x-single-active-consumer": true), and messages put
	// back after a lost connection are delivered again, possibly after
	// later ones.
	Ordered bool

	// DeadLetter is where poison messages are copied.
	DeadLetter DeadLetterConfig
	// ConfirmTimeout bounds the wait for the broker's publisher confirm of
	// a dead-letter copy, counted from when the copy is written, and a
	// write of the copy that makes no progress (the broker blocking the
	// connection under a resource alarm reads nothing more); past it
	// DeadLetter returns an error and the consumer retries. A write the
	// broker is taking is not cut: a large copy on a slow link takes what
	// the link needs. Default 10s; at least a millisecond (a unit
	// mistake: 10 is 10 ns).
	ConfirmTimeout time.Duration

	// ReconnectMinBackoff is the wait before the second attempt to
	// reconnect (the first is immediate). It doubles after each failed
	// attempt, with jitter, up to ReconnectMaxBackoff. Defaults 100ms and
	// 10s; each at least a millisecond (a unit mistake: 10 is 10 ns). The
	// source retries for as long as Receive's context allows, also when
	// the broker refuses a reconnect (see Open).
	ReconnectMinBackoff time.Duration
	// ReconnectMaxBackoff caps the wait between reconnect attempts.
	ReconnectMaxBackoff time.Duration

	// FallbackID: when set, every message gets Message.FallbackID, a
	// SHA-256 of its exchange, routing key, type property and body, which
	// the consumer uses as the event id when the message carries none (no
	// message-id property and no id header). Off by default, because two
	// legitimate messages with the same body, type and routing would then be
	// collapsed into one: without an id, such messages are dead-lettered
	// with kind missing-id.
	FallbackID bool

	// Logger receives connection events (lost, reconnected, giving up on a
	// publish). Default slog.Default(). Payloads and passwords are never
	// logged.
	Logger *slog.Logger
	// MeterProvider provides the once.amqp.reconnects and
	// once.amqp.dead_letter.refusals counters (ReconnectsMetric,
	// DeadLetterRefusalsMetric). Default: the global provider
	// (otel.GetMeterProvider()).
	MeterProvider metric.MeterProvider
}

// withDefaults validates cfg and returns a copy with defaults filled in.
func (cfg Config) withDefaults() (Config, error) {
	if cfg.URL == "" {
		return cfg, errors.New("amqp: Config.URL is required")
	}
	u, err := amqp091.ParseURI(cfg.URL)
	if err != nil {
		return cfg, fmt.Errorf("amqp: Config.URL %s: %w", redactURL(cfg.URL), redactErr(err, cfg.URL))
	}
	if cfg.TLSConfig != nil && u.Scheme != "amqps" {
		return cfg, fmt.Errorf("amqp: Config.TLSConfig is set but Config.URL %s is not an amqps URL", redactURL(cfg.URL))
	}
	if cfg.Queue == "" {
		return cfg, errors.New("amqp: Config.Queue is required")
	}
	if len(cfg.Queue) > 255 {
		return cfg, errors.New("amqp: Config.Queue is longer than 255 bytes")
	}
	switch cfg.QueueType {
	case "":
		cfg.QueueType = QueueClassic
	case QueueClassic, QueueQuorum:
	default:
		return cfg, fmt.Errorf("amqp: Config.QueueType %q: want %q or %q", cfg.QueueType, QueueClassic, QueueQuorum)
	}
	if v, ok := cfg.QueueArgs["x-queue-type"]; ok && v != string(cfg.QueueType) {
		return cfg, fmt.Errorf("amqp: Config.QueueArgs x-queue-type %v contradicts Config.QueueType %q", v, cfg.QueueType)
	}
	if err := checkTable("Config.QueueArgs", cfg.QueueArgs); err != nil {
		return cfg, err
	}
	for i, e := range cfg.Exchanges {
		if e.Name == "" {
			return cfg, fmt.Errorf("amqp: Config.Exchanges[%d].Name is required", i)
		}
		if err := checkShortstr(fmt.Sprintf("Config.Exchanges[%d].Name", i), e.Name); err != nil {
			return cfg, err
		}
		if err := checkShortstr(fmt.Sprintf("Config.Exchanges[%d].Kind", i), e.Kind); err != nil {
			return cfg, err
		}
		if err := checkTable(fmt.Sprintf("Config.Exchanges[%d].Args", i), e.Args); err != nil {
			return cfg, err
		}
	}
	for i, b := range cfg.Bindings {
		if b.Exchange == "" {
			return cfg, fmt.Errorf("amqp: Config.Bindings[%d].Exchange is required (queues are always bound to the default exchange)", i)
		}
		if err := checkShortstr(fmt.Sprintf("Config.Bindings[%d].Exchange", i), b.Exchange); err != nil {
			return cfg, err
		}
		if err := checkShortstr(fmt.Sprintf("Config.Bindings[%d].RoutingKey", i), b.RoutingKey); err != nil {
			return cfg, err
		}
		if err := checkTable(fmt.Sprintf("Config.Bindings[%d].Args", i), b.Args); err != nil {
			return cfg, err
		}
	}
	if err := checkShortstr("Config.ConsumerTag", cfg.ConsumerTag); err != nil {
		return cfg, err
	}
	if cfg.Prefetch < 0 || cfg.Prefetch > 65535 {
		return cfg, fmt.Errorf("amqp: Config.Prefetch %d: want 0 (default %d) to 65535", cfg.Prefetch, DefaultPrefetch)
	}
	if cfg.Prefetch == 0 {
		cfg.Prefetch = DefaultPrefetch
	}
	for _, d := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"DialTimeout", &cfg.DialTimeout, DefaultDialTimeout},
		{"Heartbeat", &cfg.Heartbeat, DefaultHeartbeat},
		{"ConfirmTimeout", &cfg.ConfirmTimeout, DefaultConfirmTimeout},
		{"ReconnectMinBackoff", &cfg.ReconnectMinBackoff, DefaultReconnectMinBackoff},
		{"ReconnectMaxBackoff", &cfg.ReconnectMaxBackoff, DefaultReconnectMaxBackoff},
	} {
		if *d.v < 0 {
			return cfg, fmt.Errorf("amqp: Config.%s %v is negative", d.name, *d.v)
		}
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"DialTimeout", cfg.DialTimeout}, {"ConfirmTimeout", cfg.ConfirmTimeout},
		{"ReconnectMinBackoff", cfg.ReconnectMinBackoff}, {"ReconnectMaxBackoff", cfg.ReconnectMaxBackoff},
	} {
		if d.v < time.Millisecond {
			// A unit mistake (DialTimeout: 10 is 10 ns): every dial would
			// time out before it began, taken for an unreachable broker
			// and retried without end; every dead-letter confirm would be
			// given up at once, and its message retried without end; the
			// reconnects would dial back to back through an outage, a
			// warning logged for each.
			return cfg, fmt.Errorf("amqp: Config.%s %v is below a millisecond (a time.Duration counts nanoseconds)", d.name, d.v)
		}
	}
	if cfg.Heartbeat < time.Second {
		// AMQP negotiates whole seconds; amqp091 takes less than one for
		// none and uses the broker's interval (60 s by default).
		return cfg, fmt.Errorf("amqp: Config.Heartbeat %v is below one second, the protocol's unit", cfg.Heartbeat)
	}
	if hb, ok := urlHeartbeat(cfg.URL); ok && hb == 0 {
		// amqp091 takes the URL's heartbeat over Config.Heartbeat, and
		// proposes none for 0: the broker's interval would apply.
		return cfg, fmt.Errorf("amqp: Config.URL %s has heartbeat=0, which replaces Config.Heartbeat with the broker's interval (60 s by default); drop the parameter", redactURL(cfg.URL))
	}
	if cfg.ReconnectMaxBackoff < cfg.ReconnectMinBackoff {
		return cfg, fmt.Errorf("amqp: Config.ReconnectMaxBackoff %v is below Config.ReconnectMinBackoff %v", cfg.ReconnectMaxBackoff, cfg.ReconnectMinBackoff)
	}
	if cfg.ConnectionName == "" {
		cfg.ConnectionName = "once " + cfg.Queue
	}
	dl := &cfg.DeadLetter
	defaultQueue := dl.Queue == "" && !dl.NoQueue
	if defaultQueue {
		dl.Queue = cfg.Queue + DeadLetterQueueSuffix
	}
	if dl.NoQueue {
		if dl.Queue != "" {
			return cfg, fmt.Errorf("amqp: Config.DeadLetter.Queue %q is set with Config.DeadLetter.NoQueue, which declares no queue; "+
				"drop one (with NoQueue, give the routing key in Config.DeadLetter.RoutingKey)", dl.Queue)
		}
		if dl.Exchange == "" {
			return cfg, errors.New("amqp: Config.DeadLetter.NoQueue needs Config.DeadLetter.Exchange: the default exchange routes only to queues by name")
		}
	}
	if dl.Queue == cfg.Queue {
		return cfg, errors.New("amqp: Config.DeadLetter.Queue must differ from Config.Queue")
	}
	if dl.RoutingKey == "" {
		dl.RoutingKey = dl.Queue
	}
	if dl.Exchange == "" && dl.RoutingKey != dl.Queue {
		return cfg, fmt.Errorf("amqp: Config.DeadLetter.RoutingKey %q must equal Config.DeadLetter.Queue %q on the default exchange", dl.RoutingKey, dl.Queue)
	}
	for i, e := range cfg.Exchanges {
		if e.Name != dl.Exchange || dl.Exchange == "" {
			continue
		}
		// One of the exchanges declared above: the dead-letter one is
		// the same, of the same kind, or the broker refuses the second
		// declaration ("inequivalent arg 'type'").
		kind := e.Kind
		if kind == "" {
			kind = DefaultExchangeKind
		}
		if dl.ExchangeKind != "" && dl.ExchangeKind != kind {
			return cfg, fmt.Errorf("amqp: Config.DeadLetter.ExchangeKind %q contradicts Config.Exchanges[%d].Kind %q of the same exchange %q; leave it empty", dl.ExchangeKind, i, kind, dl.Exchange)
		}
		dl.ExchangeKind = kind
		break
	}
	if dl.ExchangeKind == "" {
		dl.ExchangeKind = DefaultExchangeKind
	}
	for i, b := range cfg.Bindings {
		if b.Exchange != dl.Exchange || dl.Exchange == "" {
			continue
		}
		var back bool
		switch dl.ExchangeKind {
		case "direct":
			back = b.RoutingKey == dl.RoutingKey
		case "fanout", "headers":
			// A headers exchange routes by headers, and a copy carries the
			// original's: those that came by this binding match it again.
			back = true
		case "topic":
			back = topicMatch(b.RoutingKey, dl.RoutingKey)
		}
		if back {
			// The copy would go back into the queue too, be taken for a
			// new message, fail and be dead-lettered again, without end.
			return cfg, fmt.Errorf("amqp: Config.DeadLetter.RoutingKey %q on %s exchange %q matches Config.Bindings[%d] (key %q) of Config.Queue: dead-letter copies (with the original headers) would be routed back into the queue, to fail and be dead-lettered again without end",
				dl.RoutingKey, dl.ExchangeKind, dl.Exchange, i, b.RoutingKey)
		}
	}
	if defaultQueue && len(dl.Queue) > 255 {
		return cfg, fmt.Errorf("amqp: Config.DeadLetter.Queue: its default, Config.Queue plus %q, is longer than AMQP's 255 bytes; set it", DeadLetterQueueSuffix)
	}
	for _, f := range []struct{ name, v string }{
		{"Config.DeadLetter.Queue", dl.Queue},
		{"Config.DeadLetter.Exchange", dl.Exchange},
		{"Config.DeadLetter.ExchangeKind", dl.ExchangeKind},
		{"Config.DeadLetter.RoutingKey", dl.RoutingKey},
	} {
		if err := checkShortstr(f.name, f.v); err != nil {
			return cfg, err
		}
	}
	if v, ok := dl.QueueArgs["x-queue-type"]; ok && v != string(cfg.QueueType) {
		return cfg, fmt.Errorf("amqp: Config.DeadLetter.QueueArgs x-queue-type %v contradicts Config.QueueType %q", v, cfg.QueueType)
	}
	if err := checkTable("Config.DeadLetter.QueueArgs", dl.QueueArgs); err != nil {
		return cfg, err
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return cfg, nil
}

// checkShortstr refuses a value of field that AMQP carries as a short
// string, over 255 bytes: amqp091 would not write the frame and would drop
// the connection, which Open would take for a lost one and retry forever.
func checkShortstr(field, v string) error {
	if len(v) > 255 {
		return fmt.Errorf("amqp: %s is longer than AMQP's 255 bytes", field)
	}
	return nil
}

// checkTable refuses an argument table of field that amqp091 cannot
// write: a Go type AMQP has no field type for (uint64, []string, ...), a
// key over 255 bytes or an int outside 32 bits, at any depth.
func checkTable(field string, t amqp091.Table) error {
	if err := t.Validate(); err != nil {
		return fmt.Errorf("amqp: %s: %w", field, err)
	}
	return checkKeys(field, t)
}

// checkKeys refuses keys over 255 bytes in t and the tables nested in it,
// and Go ints outside 32 bits, which amqp091 would cut.
func checkKeys(field string, v any) error {
	switch x := v.(type) {
	case amqp091.Table:
		for k, e := range x {
			if len(k) > 255 {
				return fmt.Errorf("amqp: %s: key %.20q... is longer than AMQP's 255 bytes", field, k)
			}
			if err := checkKeys(field, e); err != nil {
				return err
			}
		}
	case []any:
		for _, e := range x {
			if err := checkKeys(field, e); err != nil {
				return err
			}
		}
	case int:
		// amqp091 writes a Go int as AMQP's 32-bit integer, high bits cut
		// off: 10 GB would reach the broker as 1,410,065,408.
		if x != int(int32(x)) {
			return fmt.Errorf("amqp: %s: int %d does not fit the 32-bit integer amqp091 writes an int as; give it as int64", field, x)
		}
	}
	return nil
}

// urlHeartbeat returns the heartbeat parameter of an AMQP URL, in seconds,
// and whether it has one.
func urlHeartbeat(raw string) (uint64, bool) {
	u, err := url.Parse(raw)
	if err != nil || !u.Query().Has("heartbeat") {
		return 0, false
	}
	hb, err := strconv.ParseUint(u.Query().Get("heartbeat"), 10, 16)
	if err != nil {
		return 0, false // amqp091.ParseURI refused it already
	}
	return hb, true
}

// redactURL returns raw with its password replaced by "xxxxx". A URL that
// does not parse is replaced entirely, since it may hold a password.
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparsable URL>"
	}
	return u.Redacted()
}

// redactErr removes the URL's password from err's text, for errors of
// libraries that quote the URL they were given.
func redactErr(err error, raw string) error {
	if err == nil {
		return nil
	}
	u, perr := url.Parse(raw)
	if perr != nil || u.User == nil {
		// The parser quotes the URL escaped (%q): a password with a quote
		// or a control character appears in that form only. An invalid
		// escape is quoted alone, and may be part of the password.
		msg := err.Error()
		q := strconv.Quote(raw)
		msg = strings.ReplaceAll(msg, q[1:len(q)-1], "<URL>")
		msg = strings.ReplaceAll(msg, raw, "<URL>")
		var esc url.EscapeError
		if errors.As(err, &esc) {
			msg = strings.ReplaceAll(msg, esc.Error(), "invalid URL escape (a % not followed by two hexadecimal digits)")
		}
		if msg != err.Error() {
			return errors.New(msg)
		}
		return err
	}
	pw, ok := u.User.Password()
	if !ok || pw == "" || !strings.Contains(err.Error(), pw) {
		return err
	}
	// The broker's refusals name the user, which may hold the password
	// (guest:guest): the copy keeps the error's type and code, which say
	// whether retrying can help.
	var ae *amqp091.Error
	if errors.As(err, &ae) {
		c := *ae
		c.Reason = strings.ReplaceAll(c.Reason, pw, "xxxxx")
		if !strings.Contains(c.Error(), pw) {
			return &c
		}
	}
	return errors.New(strings.ReplaceAll(err.Error(), pw, "xxxxx"))
}

// topicMatch reports whether a topic exchange routes key by the binding
// pattern: words separated by dots, "*" matching one word and "#" zero or
// more, as RabbitMQ matches them (an empty key or pattern has no words).
func topicMatch(pattern, key string) bool {
	words := func(s string) []string {
		if s == "" {
			return nil
		}
		return strings.Split(s, ".")
	}
	var match func(p, k []string) bool
	match = func(p, k []string) bool {
		for len(p) > 0 {
			switch p[0] {
			case "#":
				for i := 0; i <= len(k); i++ {
					if match(p[1:], k[i:]) {
						return true
					}
				}
				return false
			case "*":
			default:
				if len(k) > 0 && k[0] != p[0] {
					return false
				}
			}
			if len(k) == 0 {
				return false
			}
			p, k = p[1:], k[1:]
		}
		return len(k) == 0
	}
	return match(words(pattern), words(key))
}

// deliveryLimitArg is the quorum queue argument that bounds deliveries.
const deliveryLimitArg = "x-delivery-limit"

// checkDeliveryLimit refuses, on a broker of the given version before
// RabbitMQ 4, an x-delivery-limit below 1 in the quorum queue arguments
// args of field, whatever number type gives it (deliveryLimitValue). RabbitMQ 4 takes -1 for no limit (docs/amqp.md,
// Pitfalls); RabbitMQ 3 takes it for 0 and drops a message at its first
// redelivery, and the source's queues have no dead-letter exchange.
// An unknown version is not judged.
func checkDeliveryLimit(field string, args amqp091.Table, version string) error {
	v, ok := args[deliveryLimitArg]
	if !ok {
		return nil
	}
	limit, isNumber := deliveryLimitValue(v)
	if !isNumber {
		return nil // a string: the broker applies no limit
	}
	m, known := majorVersion(version)
	if limit >= 1 || !known || m >= 4 {
		return nil
	}
	return &configError{fmt.Errorf("amqp: %s %s %v (%T) on RabbitMQ %s: before RabbitMQ 4 a quorum queue takes a limit below 1 for 0 "+
		"and drops every message at its first redelivery (every unacked message is redelivered after a lost connection); "+
		"leave it out, RabbitMQ 3 has no limit by default", field, deliveryLimitArg, v, v, version)}
}

// configError is the source's own verdict on the configuration against
// the broker it reached, which retrying does not change.
type configError struct{ err error }

func (e *configError) Error() string { return e.err.Error() }
func (e *configError) Unwrap() error { return e.err }

// deadLetterExchangeArg is the queue argument naming the exchange the
// broker dead-letters the queue's messages to (past a delivery limit, a
// TTL, a length limit).
const deadLetterExchangeArg = "x-dead-letter-exchange"

// rabbitMQ4DeliveryLimit is the delivery limit RabbitMQ 4 gives a quorum
// queue declared without x-delivery-limit.
const rabbitMQ4DeliveryLimit = 20

// deliveryLimitRisk returns the delivery limit past which a quorum queue
// declared with args, on a broker of the given version, drops a message:
// the x-delivery-limit of args when it is 1 or more, RabbitMQ 4's default
// of 20 when args give none, and 0 when there is no such limit or args
// name a dead-letter exchange (the broker then moves the message there).
// A policy may add a dead-letter exchange or change the limit; it is not
// seen here.
func deliveryLimitRisk(args amqp091.Table, version string) int64 {
	if _, ok := args[deadLetterExchangeArg]; ok {
		return 0
	}
	return deliveryLimit(args, version)
}

// deliveryLimit returns how many times a quorum queue declared with args,
// on a broker of the given version, delivers a message again before it
// dead-letters it to the queue's dead-letter exchange or, without one,
// drops it: the x-delivery-limit of args when it is 1 or more, RabbitMQ
// 4's default of 20 when args give none, 0 for no limit.
func deliveryLimit(args amqp091.Table, version string) int64 {
	v, ok := args[deliveryLimitArg]
	if !ok {
		if m, known := majorVersion(version); known && m >= 4 {
			return rabbitMQ4DeliveryLimit
		}
		return 0
	}
	limit, _ := deliveryLimitValue(v)
	return max(limit, 0)
}

// deliveryLimitValue returns the delivery limit the broker applies for v,
// an x-delivery-limit of an argument table, and whether it applies one.
// RabbitMQ takes any number, not only a signed integer: an unsigned one
// (uint8, uint16, uint32) as it is, and a float as the whole number below
// it, since it drops a message delivered more often than the limit (0.5
// acts as 0, 1.5 as 1; measured on 3.10). A float is what a limit read
// from JSON or YAML into a map decodes to. A string is taken for no limit.
func deliveryLimitValue(v any) (int64, bool) {
	switch n := v.(type) {
	case int:
		return int64(n), true
	case int8:
		return int64(n), true
	case int16:
		return int64(n), true
	case int32:
		return int64(n), true
	case int64:
		return n, true
	case uint8:
		return int64(n), true
	case uint16:
		return int64(n), true
	case uint32:
		return int64(n), true
	case float32:
		return floatLimit(float64(n)), true
	case float64:
		return floatLimit(n), true
	}
	return 0, false
}

// floatLimit is the whole number below f, within int64 (NaN as 0).
func floatLimit(f float64) int64 {
	switch {
	case math.IsNaN(f):
		return 0
	case f >= math.MaxInt64:
		return math.MaxInt64
	case f <= math.MinInt64:
		return math.MinInt64
	}
	return int64(math.Floor(f))
}

// majorVersion returns the major number of a broker's version property
// ("4.0.5": 4), and whether it could be read.
func majorVersion(version string) (int, bool) {
	major, _, _ := strings.Cut(version, ".")
	m, err := strconv.Atoi(major)
	return m, err == nil
}

// versionBefore reports whether a broker's version property is known to
// be older than major.minor.
func versionBefore(version string, major, minor int) bool {
	maj, rest, _ := strings.Cut(version, ".")
	mi, _, _ := strings.Cut(rest, ".")
	m, err1 := strconv.Atoi(maj)
	n, err2 := strconv.Atoi(mi)
	if err1 != nil || err2 != nil {
		return false
	}
	return m < major || (m == major && n < minor)
}
