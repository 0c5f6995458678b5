package idempotency

import "time"

// SetFinishTimeout sets the bound of the middleware's own statements after
// a request's transaction has its outcome, and returns a function that
// restores it. Tests that call it must not run in parallel.
func SetFinishTimeout(d time.Duration) (restore func()) {
	old := finishTimeout
	finishTimeout = d
	return func() { finishTimeout = old }
}
