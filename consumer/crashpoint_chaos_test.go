//go:build chaos

package consumer_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/onceco/once/consumer"
)

// Each crash point kills the consumer process (exit status 86) at the step
// it names; a restarted consumer then ends with every effect exactly once.
func TestCrashPoints(t *testing.T) {
	for _, point := range consumer.CrashPoints {
		if point == "after-dead-letter" {
			continue // the table-backed test queue has no dead-letter destination
		}
		t.Run(point, func(t *testing.T) {
			const total = 400
			pool, schema := newTableQueue(t, total)
			out := runCrashChild(t, schema, 86, "ONCE_CRASH_AT=0", "ONCE_CRASH_POINT="+point+":3")
			assert.Contains(t, out, "chaos crash at "+point)
			recoverAndCount(t, pool, total)
		})
	}
}
