package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/onceco/once/internal/backoff"
)

// SourcePanicLimit is how many times in a row a call of a custom Source
// (ProgressRecorder.RecordProgress, FirstPositionChecker.FirstPositionDone,
// Delivery.DeadLetter) may panic on the same work before Run gives up on
// the source: it then stops as on a fatal Receive error, returning an
// error that wraps ErrSourceBroken and names the call, and leaves the
// messages it could not settle unacked for the broker to deliver again.
// Fewer panics are retried as the infrastructure failures their errors
// would be (a source whose state a rebalance left half-built may recover);
// a call that panics every time is a bug that no retry cures, and
// retrying it for ever would hold its stream, or its message, with no way
// out but a warning at each try.
const SourcePanicLimit = 5

// infraRetrier backs off between a loop's tries of work that failed on
// infrastructure, and counts the tries in a row that the source's panic
// failed (sourcePanicked).
type infraRetrier struct {
	backoff.Retrier
	panics int
}

// Reset starts the count of failures in a row again.
func (r *infraRetrier) Reset() {
	r.Retrier.Reset()
	r.panics = 0
}

// brokenSource holds the error of a source given up on after
// SourcePanicLimit panics in a row, and ends the receive loop.
type brokenSource struct {
	err atomic.Pointer[error]
	// stopReceiving ends Run's receive loop; set before the workers start.
	stopReceiving context.CancelFunc
}

// sourcePanicked counts err, the failure of a try of a loop whose
// failures in a row panics holds, and reports whether the source has now
// panicked SourcePanicLimit times in a row there: then Run is stopped with
// err (the first such err, when several loops give up), and the loop must
// give its work up.
func (p *pipeline) sourcePanicked(ctx context.Context, panics *int, err error) bool {
	if !errors.Is(err, ErrSourceBroken) {
		*panics = 0
		return false
	}
	*panics++
	if *panics < SourcePanicLimit {
		return false
	}
	if p.broken.err.CompareAndSwap(nil, &err) {
		p.cfg.Telemetry.Logger.ErrorContext(ctx, fmt.Sprintf("once: the source panicked %d times in a row on the same work; stopping Run, "+
			"the messages it did not settle are left to the broker", SourcePanicLimit), "consumer", p.cfg.Name, "error", err)
		if p.broken.stopReceiving != nil {
			p.broken.stopReceiving()
		}
	}
	return true
}

// brokenErr returns the error Run stops with when the source was given
// up on (sourcePanicked), nil otherwise.
func (p *pipeline) brokenErr() error {
	if err := p.broken.err.Load(); err != nil {
		return fmt.Errorf("once: consumer %q: %w", p.cfg.Name, *err)
	}
	return nil
}
