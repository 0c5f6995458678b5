package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// The times once status and once dlq print say their zone, as the
// console's do: a bare time on a terminal of another zone reads as local,
// hours off.
func TestPrintedTimesSayTheirZone(t *testing.T) {
	at := time.Date(2026, 11, 29, 20, 30, 0, 0, time.FixedZone("CET", 3600))
	assert.Equal(t, "2026-11-29 19:30:00 UTC", formatTime(at))
	assert.Equal(t, "-", formatTime(time.Time{}))
}
