package consumer

import (
	"fmt"
	"maps"
	"reflect"
	"sort"

	"github.com/jackc/pgx/v5/pgxpool"
)

// UnknownTypePolicy says what a Router does with an event type that has no
// handler.
type UnknownTypePolicy int

const (
	// DeadLetterUnknownTypes dead-letters the message with kind
	// KindUnknownType. The default: a type nobody handles is usually a
	// deployment mistake, and the DLQ keeps the message for replay.
	DeadLetterUnknownTypes UnknownTypePolicy = iota
	// SkipUnknownTypes records the event id as processed without running a
	// handler and acks it, counted in Stats.Skipped. Use it when a topic
	// carries types this service does not care about.
	SkipUnknownTypes
)

// RouterConfig configures a Router.
type RouterConfig struct {
	// UnknownTypes is the policy for event types without a handler,
	// including messages with no type. Defaults to DeadLetterUnknownTypes.
	UnknownTypes UnknownTypePolicy
}

// Router holds one typed handler per event type, for the events of one
// family T: every handler's payload type must be assignable to T. T is the
// consumer's type parameter (NewRouted returns a *Consumer[T]): an
// interface the event types share (for example one with an EventType
// method, see AddHandler), or any for a router that takes every type.
// Register handlers with Handle or AddHandler before passing the router to
// NewRouted. The zero Router is ready to use, with RouterConfig's
// defaults. A Router is not safe for concurrent registration, and
// registering after NewRouted has no effect on that consumer.
type Router[T any] struct {
	cfg    RouterConfig
	routes map[string]route
}

// route is one event type's handler in a Router.
type route struct {
	prepare preparer
	// payload is the handler's payload type, which NewRouted checks
	// against the Config's Decoder (decodableBy).
	payload reflect.Type
}

// NewRouter returns an empty router for events of family T. For example
//
//	r := consumer.NewRouter[any](consumer.RouterConfig{})
//
// takes handlers of any payload type, and
//
//	r := consumer.NewRouter[OrderEvent](consumer.RouterConfig{})
//
// only handlers whose payload types implement OrderEvent.
func NewRouter[T any](cfg RouterConfig) *Router[T] {
	return &Router[T]{cfg: cfg, routes: map[string]route{}}
}

// EventTyper is implemented by payload types that name their own event
// type, called on the zero value: AddHandler registers a handler under
// that name, so the type name and the payload type cannot disagree.
type EventTyper interface {
	// EventType returns the event type of the payload, e.g. "order.paid".
	// It must not depend on the value: AddHandler calls it on the zero
	// value (for a pointer type, on a pointer to a zero value, never on
	// nil).
	EventType() string
}

// AddHandler registers h for the events of type P.EventType(), decoded into
// P: the registration is typed end to end, the event type named by the
// payload type itself. It fails as Handle does, and for an interface P,
// which has no value to call EventType on (register such a handler with
// Handle).
//
//	type OrderPaid struct{ OrderID string }
//
//	func (OrderPaid) EventType() string { return "order.paid" }
//
//	err := consumer.AddHandler(r, func(ctx context.Context, tx pgx.Tx, ev consumer.Event[OrderPaid]) error { ... })
func AddHandler[T any, P EventTyper](r *Router[T], h Handler[P]) error {
	var zero P
	switch t := reflect.TypeFor[P](); t.Kind() {
	case reflect.Pointer:
		// A nil pointer would panic in a value method, or in a pointer
		// method that reads its receiver.
		zero = reflect.New(t.Elem()).Interface().(P)
	case reflect.Interface:
		return fmt.Errorf("%w: handler takes %v, an interface: AddHandler has no value to call its EventType on; register it with Handle",
			ErrInvalidConfig, t)
	}
	return Handle(r, zero.EventType(), h)
}

// Handle registers h for events of type eventType, decoded into P. It fails
// with an error wrapping ErrInvalidConfig for an empty type, a nil handler,
// a type registered before, or a P that is not assignable to the router's
// family T. A P that is an interface with methods needs a Config.Decoder
// that fills it: NewRouted refuses it without one.
func Handle[T, P any](r *Router[T], eventType string, h Handler[P]) error {
	switch {
	case r == nil:
		return fmt.Errorf("%w: router is nil", ErrInvalidConfig)
	case eventType == "":
		return fmt.Errorf("%w: event type is empty", ErrInvalidConfig)
	case h == nil:
		return fmt.Errorf("%w: handler for %q is nil", ErrInvalidConfig, eventType)
	}
	if family, payload := reflect.TypeFor[T](), reflect.TypeFor[P](); !payload.AssignableTo(family) {
		return fmt.Errorf("%w: handler for %q takes %v, which is not a %v (the router's family)", ErrInvalidConfig, eventType, payload, family)
	}
	if _, dup := r.routes[eventType]; dup {
		return fmt.Errorf("%w: a handler for %q is already registered", ErrInvalidConfig, eventType)
	}
	if r.routes == nil {
		r.routes = map[string]route{}
	}
	r.routes[eventType] = route{payload: reflect.TypeFor[P](), prepare: func(m *Message, idt identity, dec Decoder) (prepared, ErrorKind, error) {
		c, kind, err := bind(h, m, idt, dec)
		return prepared{call: c}, kind, err
	}}
	return nil
}

// Types returns the registered event types, sorted; none for a nil
// router.
func (r *Router[T]) Types() []string {
	if r == nil {
		return nil
	}
	types := make([]string, 0, len(r.routes))
	for t := range r.routes {
		types = append(types, t)
	}
	sort.Strings(types)
	return types
}

// routeTable is a router's routes frozen for one consumer.
type routeTable struct {
	cfg    RouterConfig
	routes map[string]route
}

func (r *routeTable) prepare(m *Message, idt identity, dec Decoder) (prepared, ErrorKind, error) {
	route, ok := r.routes[idt.typ]
	if ok {
		return route.prepare(m, idt, dec)
	}
	if r.cfg.UnknownTypes == SkipUnknownTypes {
		return prepared{}, "", nil
	}
	return prepared{}, KindUnknownType, fmt.Errorf("no handler for event type %q", idt.typ)
}

// NewRouted returns a consumer that dispatches each message to the
// router's handler for its event type (Message.Type, else the
// Config.Identify.TypeHeaders, else the envelope's type). The router must
// have at least one handler; later registrations do not reach the
// consumer. Errors as for New, and, without a Config.Decoder, for a
// handler whose payload type is an interface with methods, which the
// default JSON decoder cannot fill (register such a handler only with a
// Decoder that can).
func NewRouted[T any](pool *pgxpool.Pool, src Source, r *Router[T], cfg Config) (*Consumer[T], error) {
	if r == nil || len(r.routes) == 0 {
		return nil, fmt.Errorf("%w: router has no handlers", ErrInvalidConfig)
	}
	if r.cfg.UnknownTypes != DeadLetterUnknownTypes && r.cfg.UnknownTypes != SkipUnknownTypes {
		return nil, fmt.Errorf("%w: RouterConfig.UnknownTypes %d is not a known policy", ErrInvalidConfig, r.cfg.UnknownTypes)
	}
	for _, typ := range r.Types() {
		if t := r.routes[typ].payload; !decodableBy(t, cfg) {
			return nil, fmt.Errorf("%w: the handler for %q takes %v, an interface, which the default JSON decoder cannot decode into "+
				"(every message of that type would be dead-lettered): take a concrete type, or set Decoder", ErrInvalidConfig, typ, t)
		}
	}
	frozen := &routeTable{cfg: r.cfg, routes: maps.Clone(r.routes)}
	p, err := newPipeline(pool, src, cfg, frozen.prepare)
	if err != nil {
		return nil, err
	}
	return &Consumer[T]{p: p}, nil
}
