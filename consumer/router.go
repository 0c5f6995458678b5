package consumer

import (
	"fmt"
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

// Router holds one typed handler per event type. Register handlers with
// Handle before passing the router to NewRouted; a Router is not safe for
// concurrent registration, and registering after NewRouted has no effect
// on that consumer.
type Router struct {
	cfg    RouterConfig
	routes map[string]preparer
}

// NewRouter returns an empty router.
func NewRouter(cfg RouterConfig) *Router {
	return &Router{cfg: cfg, routes: map[string]preparer{}}
}

// Handle registers h for events of type eventType, decoded into T. It fails
// for an empty type, a nil handler, or a type registered before.
func Handle[T any](r *Router, eventType string, h Handler[T]) error {
	switch {
	case eventType == "":
		return fmt.Errorf("%w: event type is empty", ErrInvalidConfig)
	case h == nil:
		return fmt.Errorf("%w: handler for %q is nil", ErrInvalidConfig, eventType)
	}
	if _, dup := r.routes[eventType]; dup {
		return fmt.Errorf("%w: a handler for %q is already registered", ErrInvalidConfig, eventType)
	}
	r.routes[eventType] = func(m *Message, idt identity, dec Decoder) (prepared, ErrorKind, error) {
		c, kind, err := bind(h, m, idt, dec)
		return prepared{call: c}, kind, err
	}
	return nil
}

// Types returns the registered event types, sorted.
func (r *Router) Types() []string {
	types := make([]string, 0, len(r.routes))
	for t := range r.routes {
		types = append(types, t)
	}
	sort.Strings(types)
	return types
}

func (r *Router) prepare(m *Message, idt identity, dec Decoder) (prepared, ErrorKind, error) {
	route, ok := r.routes[idt.typ]
	if ok {
		return route(m, idt, dec)
	}
	if r.cfg.UnknownTypes == SkipUnknownTypes {
		return prepared{}, "", nil
	}
	return prepared{}, KindUnknownType, fmt.Errorf("no handler for event type %q", idt.typ)
}

// NewRouted returns a consumer that dispatches each message to the
// router's handler for its event type (Message.Type, else the
// Config.TypeHeaders, else the envelope's type). The router must have at
// least one handler. Errors as for New.
func NewRouted(pool *pgxpool.Pool, src Source, r *Router, cfg Config) (*Consumer[any], error) {
	if r == nil || len(r.routes) == 0 {
		return nil, fmt.Errorf("%w: router has no handlers", ErrInvalidConfig)
	}
	if r.cfg.UnknownTypes != DeadLetterUnknownTypes && r.cfg.UnknownTypes != SkipUnknownTypes {
		return nil, fmt.Errorf("%w: RouterConfig.UnknownTypes %d is not a known policy", ErrInvalidConfig, r.cfg.UnknownTypes)
	}
	routes := make(map[string]preparer, len(r.routes))
	for k, v := range r.routes {
		routes[k] = v
	}
	frozen := &Router{cfg: r.cfg, routes: routes}
	p, err := newPipeline(pool, src, cfg, frozen.prepare)
	if err != nil {
		return nil, err
	}
	return &Consumer[any]{p: p}, nil
}
