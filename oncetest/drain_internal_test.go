package oncetest

import (
	"context"
	"testing"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
)

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
	failed := FatalOf(t, func(tb testing.TB) {
		drainRun(tb, run, func() consumer.Stats { return consumer.Stats{} }, b, DrainTimeout)
	})
	if !live {
		t.Fatal("Run was called with a context that had ended")
	}
	if b.IsAcked(0) {
		t.Fatal("the message was acked")
	}
	if failed == "" {
		t.Fatal("Drain passed although Run returned before it stopped it, with a message unsettled")
	}
	t.Logf("Drain failed with: %s", failed)
}
