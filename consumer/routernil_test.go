package consumer_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/onceco/once/consumer"
)

// A nil *Router has no handlers: Types says so, as Handle and NewRouted
// refuse it with an error. It panicked on the nil pointer.
func TestNilRouterHasNoTypes(t *testing.T) {
	var r *consumer.Router[any]
	assert.NotPanics(t, func() { assert.Empty(t, r.Types()) })
}

// A Consumer not built by New, NewRouted or NewBatch (a nil one, left by
// a constructor whose error was dropped, or the zero value) refuses Run
// with ErrInvalidConfig and has zero Stats. Both panicked on the nil
// pointer; Run's panic ended the process from the goroutine it ran in.
func TestConsumerNotBuiltByNewRefusesRun(t *testing.T) {
	for name, c := range map[string]*consumer.Consumer[order]{"nil": nil, "zero": {}} {
		t.Run(name, func(t *testing.T) {
			var err error
			assert.NotPanics(t, func() { err = c.Run(t.Context()) })
			assert.ErrorIs(t, err, consumer.ErrInvalidConfig)
			assert.NotPanics(t, func() { assert.Zero(t, c.Stats()) })
		})
	}
}
