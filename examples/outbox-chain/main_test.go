package main

import (
	"strings"
	"testing"
)

// The demo shows a re-published batch: it passes only when the relay's
// session was killed and the batch went out again.
func TestDemoVerdictPasses(t *testing.T) {
	if err := run(600); err != nil {
		t.Fatalf("run: %v", err)
	}
}

// With one order there is one batch, never the third that the kill
// follows: the demo must not pass as if it had shown a re-published batch.
func TestDemoFailsWhenNoSessionWasKilled(t *testing.T) {
	err := run(1)
	if err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("run(1) = %v, want an error saying no relay session was killed", err)
	}
}
