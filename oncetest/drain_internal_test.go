package oncetest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
)

// failRecorder is a testing.TB whose Fatalf is recorded and ends the
// calling goroutine, as the real one does.
type failRecorder struct {
	testing.TB
	mu     sync.Mutex
	failed string
}

func (r *failRecorder) Helper() {}

func (r *failRecorder) Fatalf(format string, args ...any) {
	r.mu.Lock()
	r.failed = fmt.Sprintf(format, args...)
	r.mu.Unlock()
	panic(errRecorded)
}

var errRecorded = errors.New("recorded")

// A Run that returns nil before its context ends (a consumer that stops
// receiving on its own) failed no test: Drain took the end of Run for the
// end of the drain, and passed with the messages published before it
// never settled.
func TestDrainFailsWhenRunReturnsNilOnItsOwn(t *testing.T) {
	b := memsource.New(memsource.Options{})
	b.Publish(consumer.Message{ID: "never", Value: []byte(`"never"`)})
	var live bool
	run := func(ctx context.Context) error {
		live = ctx.Err() == nil
		return nil
	}
	rec := &failRecorder{TB: t}
	func() {
		defer func() {
			if p := recover(); p != nil && p != errRecorded { //nolint:errorlint // the sentinel itself
				panic(p)
			}
		}()
		drainRun(rec, run, func() consumer.Stats { return consumer.Stats{} }, b, DrainTimeout)
	}()
	if !live {
		t.Fatal("Run was called with a context that had ended")
	}
	if b.IsAcked(0) {
		t.Fatal("the message was acked")
	}
	if rec.failed == "" {
		t.Fatal("Drain passed although Run returned before it stopped it, with a message unsettled")
	}
	t.Logf("Drain failed with: %s", rec.failed)
}
