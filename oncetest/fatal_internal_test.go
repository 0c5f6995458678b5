package oncetest

import (
	"errors"
	"fmt"
	"sync"
	"testing"
)

// fatalRecorder is a testing.TB whose Fatalf is recorded and ends the
// calling goroutine, as the real one does.
type fatalRecorder struct {
	testing.TB
	mu     sync.Mutex
	failed string
}

func (r *fatalRecorder) Helper() {}

func (r *fatalRecorder) Fatalf(format string, args ...any) {
	r.mu.Lock()
	r.failed = fmt.Sprintf(format, args...)
	r.mu.Unlock()
	panic(errFatal)
}

var errFatal = errors.New("fatal")

// FatalOf runs f on a testing.TB that stands for t but records its Fatalf
// instead of failing t, and returns the message f failed with, "" when
// it passed. A Fatalf ends f as the real one ends a test's goroutine; any
// other panic goes on. It is defined for this package's tests only, and
// may be called from several goroutines at once.
func FatalOf(t testing.TB, f func(tb testing.TB)) string {
	t.Helper()
	rec := &fatalRecorder{TB: t}
	func() {
		defer func() {
			if p := recover(); p != nil {
				if err, ok := p.(error); !ok || !errors.Is(err, errFatal) {
					panic(p)
				}
			}
		}()
		f(rec)
	}()
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return rec.failed
}
