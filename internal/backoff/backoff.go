// Package backoff paces every retry of the library: handler retries,
// waits after infrastructure failures, broker reconnects and dead-letter
// publishing. One policy shape and one jitter, so that all of them behave
// alike and many consumers never retry in step.
package backoff

import (
	"context"
	"math/rand/v2"
	"time"
)

// Policy is an exponential backoff: the wait before retry n (n >= 1) is
// Initial * 2^(n-1), capped at Max, spread by ±20% jitter.
type Policy struct {
	// Initial is the first wait. Zero means no wait.
	Initial time.Duration
	// Max caps the wait. Zero means Initial.
	Max time.Duration
}

// Delay returns the jittered wait before retry n (1-based). n below 1 is
// taken as 1.
func (p Policy) Delay(n int) time.Duration {
	limit := max(p.Max, p.Initial)
	d := p.Initial
	for i := 1; i < n && d < limit; i++ {
		d *= 2
	}
	return Jitter(min(d, limit))
}

// Jitter spreads d by ±20%.
func Jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d*8/10 + rand.N(d*4/10+1)
}

// Sleep waits d or until ctx is done; it reports whether d elapsed (true
// at once for d <= 0 unless ctx is done).
func Sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// Retrier counts consecutive failures and waits before each retry. Reset
// it after a success. The zero value with a Policy set is ready to use; a
// Retrier is not safe for concurrent use.
type Retrier struct {
	Policy Policy
	n      int
}

// Wait counts a failure and sleeps its delay; it reports false when ctx
// ended first.
func (r *Retrier) Wait(ctx context.Context) bool {
	return Sleep(ctx, r.Delay())
}

// Delay counts a failure and returns the wait before the retry it calls
// for, for a caller that waits in its own way.
func (r *Retrier) Delay() time.Duration {
	r.n++
	return r.Policy.Delay(r.n)
}

// Reset forgets the failures counted so far.
func (r *Retrier) Reset() { r.n = 0 }

// Failures is how many waits were counted since the last Reset.
func (r *Retrier) Failures() int { return r.n }
