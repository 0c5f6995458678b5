package consumer_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// errDependencyDown is the failure of the handlers below, classified as
// each test needs it.
var errDependencyDown = errors.New("dependency down")

// waitsOf runs a consumer with cfg on one message whose handler always
// fails, until the message is dead-lettered (or, for infrastructure
// failures, until retries retries were announced), and returns the waits
// OnRetry announced for reason.
func waitsOf(t *testing.T, cfg consumer.Config, reason consumer.RetryReason, retries int) []time.Duration {
	t.Helper()
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "failing", 1)
	var mu sync.Mutex
	var waits []time.Duration
	enough := make(chan struct{})
	cfg.Hooks.OnRetry = func(ctx context.Context, r consumer.Retry) {
		mu.Lock()
		defer mu.Unlock()
		if r.Reason != reason {
			return
		}
		waits = append(waits, r.Wait)
		if len(waits) == retries {
			close(enough)
		}
	}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error { return errDependencyDown }
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	select {
	case <-enough:
	case <-time.After(30 * time.Second):
		t.Fatal("the retries were never announced")
	}
	require.NoError(t, stop())
	mu.Lock()
	defer mu.Unlock()
	return append([]time.Duration(nil), waits[:retries]...)
}

// Retry.MaxBackoff "caps the wait between attempts". Set alone, below
// InitialBackoff's default (200ms), it was ignored: the policy's limit is
// the greater of the two, so a service that asked for retries at most
// 20ms apart waited 200ms before each. InitialBackoff defaults to
// MaxBackoff when that is shorter.
func TestRetryMaxBackoffAloneCapsTheWait(t *testing.T) {
	const limit = 20 * time.Millisecond
	cfg := consumer.Config{Name: "max-backoff-alone", Retry: consumer.RetryPolicy{MaxAttempts: 4, MaxBackoff: limit}}
	for i, w := range waitsOf(t, cfg, consumer.RetryHandler, 3) {
		assert.LessOrEqual(t, w, limit*12/10, "wait %d: %v, past MaxBackoff %v and its jitter", i+1, w, limit)
	}
}

// The same for InfraBackoff.Max set alone, below Initial's default
// (100ms).
func TestInfraBackoffMaxAloneCapsTheWait(t *testing.T) {
	const limit = 10 * time.Millisecond
	cfg := consumer.Config{Name: "infra-max-alone", InfraBackoff: consumer.Backoff{Max: limit}}
	cfg.Retry.Classify = func(err error, def consumer.ErrorClass) consumer.ErrorClass {
		if errors.Is(err, errDependencyDown) {
			return consumer.ClassInfrastructure
		}
		return def
	}
	for i, w := range waitsOf(t, cfg, consumer.RetryInfrastructure, 3) {
		assert.LessOrEqual(t, w, limit*12/10, "wait %d: %v, past InfraBackoff.Max %v and its jitter", i+1, w, limit)
	}
}
