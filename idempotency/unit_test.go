package idempotency_test

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/onceco/once/idempotency"
)

// A time.Duration counts nanoseconds: AcquireTimeout: 5 (meant as 5 s) is
// 5 ns, and New took it. No pool connection and claim arrive within 5 ns,
// so every request, with a key or without (Optional), got 503 "retry"
// while the database was idle; the handler never ran. RetentionInterval:
// 60 (meant as a minute) is 60 ns: RunRetention then sends its DELETE
// back to back, forever. And an AcquireTimeout near the largest Duration
// (meant as "no bound", which is NoAcquireTimeout) overflowed with Wait
// added into a deadline already past: 503 to every request as well. New
// refuses each, as it refuses a TTL below a millisecond.
func TestNewRefusesDurationsThatCannotWork(t *testing.T) {
	for name, cfg := range map[string]idempotency.Config{
		"AcquireTimeout 5ns":          {AcquireTimeout: 5},
		"RetentionInterval 60ns":      {RetentionInterval: 60},
		"AcquireTimeout + Wait > max": {AcquireTimeout: math.MaxInt64, Wait: time.Second},
	} {
		cfg.Scope = idempotency.SingleScope
		_, err := idempotency.New(unreachablePool(t), cfg)
		assert.ErrorIs(t, err, idempotency.ErrConfig, name)
	}
	for name, cfg := range map[string]idempotency.Config{
		"AcquireTimeout 1ms":    {AcquireTimeout: time.Millisecond},
		"RetentionInterval 1ms": {RetentionInterval: time.Millisecond},
		"AcquireTimeout max":    {AcquireTimeout: math.MaxInt64},
		"no AcquireTimeout":     {AcquireTimeout: idempotency.NoAcquireTimeout, Wait: time.Second},
	} {
		cfg.Scope = idempotency.SingleScope
		_, err := idempotency.New(unreachablePool(t), cfg)
		assert.NoError(t, err, name)
	}
}
