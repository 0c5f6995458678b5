package consumer

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// feed gives c the batches of sizes, each taking fixed + perMessage·n.
func feed(c *txCost, sizes []int, fixed, perMessage time.Duration) {
	for _, n := range sizes {
		c.add(n, fixed+time.Duration(n)*perMessage)
	}
}

// mixedSizes are batch sizes as a paced stream forms them.
var mixedSizes = []int{3, 40, 12, 1, 77, 25, 8, 100, 16, 60, 5, 33}

// A handler that makes a round trip per event: most of a transaction's
// time grows with its batch, and only the fixed part is worth waiting
// for.
func TestTxCostFindsTheFixedPartOfARoundTripPerEvent(t *testing.T) {
	var c txCost
	for range 10 {
		feed(&c, mixedSizes, 2*time.Millisecond, 90*time.Microsecond)
	}
	fixed, ok := c.fixed()
	require.True(t, ok)
	assert.InDelta(t, float64(2*time.Millisecond), float64(fixed), float64(50*time.Microsecond))
}

// A batch handler whose statements cover the whole batch: its time hardly
// grows with the batch, so nearly all of it is fixed and the batcher waits
// for a running transaction as long as one takes.
func TestTxCostCountsABatchHandlersTimeAsFixed(t *testing.T) {
	var c txCost
	for range 10 {
		feed(&c, mixedSizes, 3*time.Millisecond, 2*time.Microsecond)
	}
	fixed, ok := c.fixed()
	require.True(t, ok)
	assert.InDelta(t, float64(3*time.Millisecond)+float64(2*time.Microsecond)*c.n, float64(fixed), float64(100*time.Microsecond))
}

// Batches all of one size (a full backlog) cannot tell the parts apart:
// the whole mean counts as fixed, the wait it allowed before the model.
// Nothing before the first batch: the caller's own bound applies.
func TestTxCostWithoutSpreadIsTheMean(t *testing.T) {
	var c txCost
	_, ok := c.fixed()
	assert.False(t, ok, "no batch yet")
	feed(&c, []int{100, 100, 100, 100}, time.Millisecond, 100*time.Microsecond)
	fixed, ok := c.fixed()
	require.True(t, ok)
	assert.Equal(t, 11*time.Millisecond, fixed)
}

// Times that fall as batches grow (noise, or a slow start) never give a
// fixed part above the mean or below zero.
func TestTxCostStaysWithinZeroAndTheMean(t *testing.T) {
	var c txCost
	for range 10 {
		for _, n := range mixedSizes {
			c.add(n, time.Duration(200-n)*100*time.Microsecond)
		}
	}
	fixed, ok := c.fixed()
	require.True(t, ok)
	assert.Equal(t, time.Duration(c.t), fixed, "clamped to the mean")

	var d txCost
	for range 10 {
		feed(&d, mixedSizes, 0, 100*time.Microsecond)
		d.add(50, 0) // a batch that took no time at all
	}
	fixed, ok = d.fixed()
	require.True(t, ok)
	assert.GreaterOrEqual(t, fixed, time.Duration(0))
}
