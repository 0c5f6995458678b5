package consumer_test

import "testing"

// wrapError is a user's wrapping error type whose Unwrap panics (it
// reaches into a nil cause, say); its Error method is fine.
type wrapError struct{ cause *wrapError }

func (e *wrapError) Error() string { return "wrapped" }
func (e *wrapError) Unwrap() error { return e.cause.cause }

// An error the handler returns is unwrapped (errors.As, errors.Is) to
// classify it, outside the handler's recover, as it is read: one whose
// Unwrap panics is the handler's panic, dead-lettered with kind panic,
// the message after it handled. It crashed the process, every stream
// with it, as an Error method that panicked did before
// TestHandlerErrorWhoseErrorMethodPanicsIsAPanic's fix.
func TestHandlerErrorWhoseUnwrapPanicsIsAPanic(t *testing.T) {
	unreadableErrorIsAPanic(t, "broken-unwrap", func() error { return &wrapError{} }, "the Unwrap or Is method of the handler's error")
}
