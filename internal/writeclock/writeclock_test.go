package writeclock

import (
	"context"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A write larger than a piece arrives whole, and the clock moves only
// when bytes were written.
func TestWriteArrivesWholeAndMovesTheClock(t *testing.T) {
	client, server := net.Pipe()
	defer server.Close()
	var wrote atomic.Int64
	dial := Dial(func(string, string) (net.Conn, error) { return client, nil }, &wrote)
	c, err := dial("tcp", "x")
	require.NoError(t, err)
	defer c.Close()

	payload := make([]byte, 3*chunk+5)
	for i := range payload {
		payload[i] = byte(i)
	}
	got := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(io.LimitReader(server, int64(len(payload))))
		got <- b
	}()
	assert.Zero(t, wrote.Load(), "nothing written yet")
	n, err := c.Write(payload)
	require.NoError(t, err)
	assert.Equal(t, len(payload), n)
	assert.Equal(t, payload, <-got)
	assert.NotZero(t, wrote.Load(), "the write moved the clock")
}

// Wait returns the answer when it comes, and gives up when nothing was
// written for idle, or when its context ends.
func TestWaitGivesUpOnlyOnAnIdleWriteOrItsContext(t *testing.T) {
	var wrote atomic.Int64
	done := make(chan int, 1)
	done <- 7
	got, ok := Wait(t.Context(), done, &wrote, time.Hour)
	assert.True(t, ok)
	assert.Equal(t, 7, got)

	_, ok = Wait(t.Context(), make(chan int), &wrote, time.Millisecond)
	assert.False(t, ok, "nothing written for idle")

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, ok = Wait(ctx, make(chan int), &wrote, time.Hour)
	assert.False(t, ok, "the context ended")
}
