package idempotency_test

import (
	"fmt"
	"net/http"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/onceco/once/idempotency"
)

// Clients sending one key at once, with no wait (the default): each gets
// the first's response or 409, never 503. A claim whose wait for the key
// timed out asked whether another transaction held the key still, and
// took a "no" for the session's own lock_timeout on the table: when the
// first request had ended in between (its commit a millisecond later),
// the client got 503 "Service unavailable" and the log blamed a table
// lock, for a key that was merely in flight (2 to 11 of 30 clients in a
// round). The claim is made once more then, and sees the first's response.
func TestKeyInFlightThatEndsDuringTheCheckIsNot503(t *testing.T) {
	const rounds, clients = 10, 20
	s := newService(t, idempotency.Config{}, http.HandlerFunc(insertEffect))
	statuses := map[int]int{}
	var mu sync.Mutex
	for round := range rounds {
		key := fmt.Sprintf("round-%d", round)
		var wg sync.WaitGroup
		for range clients {
			wg.Go(func() {
				r := s.post("/orders", key, "b")
				mu.Lock()
				statuses[r.status]++
				mu.Unlock()
			})
		}
		wg.Wait()
	}
	assert.Zero(t, statuses[http.StatusServiceUnavailable], "statuses: %v", statuses)
	assert.Equal(t, rounds*clients, statuses[http.StatusCreated]+statuses[http.StatusConflict], "statuses: %v", statuses)
	assert.Equal(t, rounds, s.effects(), "one effect per key")
}
