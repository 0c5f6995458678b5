package consumer

import (
	"errors"
	"fmt"
	"time"
)

// ErrTxOwnedByConsumer is what Commit and Rollback return when a handler
// (or a BatchHandler, or a middleware) calls them on the transaction the
// consumer gave it, wrapped in Permanent. The consumer owns that
// transaction: it commits it after the handlers return, with the claims of
// every message in it, so it refuses a handler's call and leaves the
// transaction as it was. Whether or not the handler then returns the
// error, its message fails permanently (dead-lettered at once with kind
// KindHandler) and its writes are rolled back; the other messages of its
// batch run again without it, and none is lost. To roll back a handler's
// writes, return an error; for a part that may fail on its own, use
// tx.Begin (a savepoint), whose Commit and Rollback work as usual.
var ErrTxOwnedByConsumer = errors.New("once: the consumer owns this transaction and commits it after the handler returns")

// Permanent wraps err to tell the consumer that retrying cannot help: the
// message is dead-lettered at once with kind KindHandler, and the handler's
// transaction is rolled back. Check for it with errors.As on
// *PermanentError.
func Permanent(err error) error {
	if err == nil {
		err = errors.New("permanent failure")
	}
	return &PermanentError{Err: err}
}

// PermanentError is the error Permanent returns. A nil *PermanentError
// (a typed nil a handler returned as an error) reads as Permanent(nil).
type PermanentError struct{ Err error }

// Error returns "permanent: " and the wrapped error's message ("permanent
// failure" when Err is nil, as Permanent(nil) says).
func (e *PermanentError) Error() string {
	if e == nil {
		return "permanent: permanent failure"
	}
	return "permanent: " + errText(e.Err, "permanent failure")
}

// Unwrap returns the wrapped error, for errors.Is and errors.As.
func (e *PermanentError) Unwrap() error {
	if e == nil {
		return nil
	}
	return e.Err
}

// RetryAfter wraps err to tell the consumer to roll back and try again
// after d instead of after the retry policy's backoff. The attempt counts
// against RetryPolicy.MaxAttempts like any other failure. A Decoder or an
// Envelope may return it too: the message is then decoded again after d
// instead of being dead-lettered at once (see Config.Decoder). Check for
// it with errors.As on *RetryAfterError.
func RetryAfter(d time.Duration, err error) error {
	if err == nil {
		err = errors.New("retry requested")
	}
	return &RetryAfterError{Delay: d, Err: err}
}

// RetryAfterError is the error RetryAfter returns. A nil
// *RetryAfterError (a typed nil a handler returned as an error) reads as
// RetryAfter(0, nil).
type RetryAfterError struct {
	Delay time.Duration
	Err   error
}

// Error names the delay and the wrapped error's message.
func (e *RetryAfterError) Error() string {
	return fmt.Sprintf("retry after %s: %s", e.delay(), errText(e.Unwrap(), "retry requested"))
}

// Unwrap returns the wrapped error, for errors.Is and errors.As.
func (e *RetryAfterError) Unwrap() error {
	if e == nil {
		return nil
	}
	return e.Err
}

// delay is the wait asked for, none for a nil e: the consumer reads it
// outside the handler's recover, where a nil pointer would end the process.
func (e *RetryAfterError) delay() time.Duration {
	if e == nil {
		return 0
	}
	return e.Delay
}

// PanicError is the error a handler's panic is turned into. Stack is the
// goroutine's stack at the panic.
type PanicError struct {
	Value any
	Stack string
}

// Error names the value the handler panicked with; the stack is in Stack.
// A nil *PanicError reads as a panic with a nil value.
func (e *PanicError) Error() string {
	if e == nil {
		return "handler panicked: <nil>"
	}
	return fmt.Sprintf("handler panicked: %v", e.Value)
}

// stack is Stack, none for a nil e (read as Delay is, see delay).
func (e *PanicError) stack() string {
	if e == nil {
		return ""
	}
	return e.Stack
}

// DecodeError wraps a failure to decode a message's payload or envelope.
// Such a message is dead-lettered at once with kind KindDecode. A Decoder
// need not return it: any decoder error is treated as one (but one
// wrapped in RetryAfter, which asks for a later try: see Config.Decoder).
// A handler that decodes something of its own (a []byte payload, a field
// in another format) may return it, wrapped or not: the message is
// dead-lettered at once with kind KindDecode too, and not retried
// (Classify), unless it returns it inside RetryAfter, which asks for a
// later run.
//
// A nil *DecodeError (a typed nil returned as an error) reads as one
// whose Err is nil.
type DecodeError struct{ Err error }

// Error returns "decode: " and the wrapped error's message ("decode
// failed" when Err is nil).
func (e *DecodeError) Error() string { return "decode: " + errText(e.Unwrap(), "decode failed") }

// Unwrap returns the wrapped error, for errors.Is and errors.As.
func (e *DecodeError) Unwrap() error {
	if e == nil {
		return nil
	}
	return e.Err
}

// errText is err's message, or none when err is nil: an outcome error a
// handler built itself may wrap nothing, and the consumer reads its
// message outside the handler's recover (the dead letter's), where a panic
// would end the process.
func errText(err error, none string) string {
	if err == nil {
		return none
	}
	return err.Error()
}
