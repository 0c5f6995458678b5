// Package testlog has a slog.Handler for the tests that check what a
// component logs at level Error: a refusal that an operator must see, as
// against the warnings of a failure that passes.
package testlog

import (
	"context"
	"log/slog"
	"strings"
	"sync"
)

// ErrorLog is a slog.Handler that keeps the records logged at level Error
// or above, each as text: its message, then " key=value" for each
// attribute, those given to Logger.With first. Records below Error are
// not kept. Groups are not written: WithGroup returns the handler itself.
// It is safe for concurrent use; the zero value is ready to use, and it
// must not be copied after its first use.
type ErrorLog struct {
	mu   sync.Mutex
	errs []string
}

// Enabled reports whether level is Error or above.
func (l *ErrorLog) Enabled(_ context.Context, level slog.Level) bool {
	return level >= slog.LevelError
}

// Handle keeps r when it is at level Error or above.
func (l *ErrorLog) Handle(_ context.Context, r slog.Record) error {
	l.keep("", r)
	return nil
}

// WithAttrs returns a handler that keeps its records in l, with attrs
// written before each record's own.
func (l *ErrorLog) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &withAttrs{l: l, text: attrText(attrs)}
}

// WithGroup returns l: groups are not written.
func (l *ErrorLog) WithGroup(string) slog.Handler { return l }

// Errors returns the text of the records kept so far, oldest first.
func (l *ErrorLog) Errors() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.errs...)
}

func (l *ErrorLog) keep(with string, r slog.Record) {
	if r.Level < slog.LevelError {
		return
	}
	var b strings.Builder
	b.WriteString(r.Message)
	b.WriteString(with)
	r.Attrs(func(a slog.Attr) bool {
		b.WriteString(attrText([]slog.Attr{a}))
		return true
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, b.String())
}

// withAttrs is an ErrorLog's handler with attributes of Logger.With.
type withAttrs struct {
	l    *ErrorLog
	text string
}

func (h *withAttrs) Enabled(ctx context.Context, level slog.Level) bool {
	return h.l.Enabled(ctx, level)
}

func (h *withAttrs) Handle(_ context.Context, r slog.Record) error {
	h.l.keep(h.text, r)
	return nil
}

func (h *withAttrs) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &withAttrs{l: h.l, text: h.text + attrText(attrs)}
}

func (h *withAttrs) WithGroup(string) slog.Handler { return h }

// attrText writes attrs as " key=value" each.
func attrText(attrs []slog.Attr) string {
	var b strings.Builder
	for _, a := range attrs {
		b.WriteString(" " + a.Key + "=" + a.Value.String())
	}
	return b.String()
}
