// Package kafkatest gives tests a real Apache Kafka broker: a throwaway
// single-node cluster shared by the test binary (Shared), or a cluster of
// the test's own (Start) for tests that kill or reconfigure brokers. Both
// come from internal/kafkatemp.
//
// When the broker cannot be started (the release is not fetched, no Java),
// a test is skipped with the reason, or fails with it when
// ONCE_REQUIRE_SERVERS=1 (make test), so a CI run never passes without the
// real broker.
package kafkatest

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/onceco/once/internal/kafkatemp"
)

var (
	sharedOnce sync.Once
	shared     *kafkatemp.Cluster
	sharedErr  error
)

// Shared returns the binary's shared single-node cluster, started at the
// first call. Tests using it must use topic and group names of their own.
// The cluster lives until the binary exits; kafkatemp's watchdog then
// stops it.
func Shared(t testing.TB) *kafkatemp.Cluster {
	t.Helper()
	sharedOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		shared, sharedErr = kafkatemp.Start(ctx, kafkatemp.Options{})
	})
	if sharedErr != nil {
		unavailable(t, sharedErr)
	}
	return shared
}

// Start starts a cluster of the test's own with opts, closed when the test
// ends.
func Start(t testing.TB, opts kafkatemp.Options) *kafkatemp.Cluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := kafkatemp.Start(ctx, opts)
	if err != nil {
		unavailable(t, err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// unavailable skips t, or fails it under ONCE_REQUIRE_SERVERS=1.
func unavailable(t testing.TB, err error) {
	t.Helper()
	if os.Getenv("ONCE_REQUIRE_SERVERS") == "1" {
		t.Fatalf("Apache Kafka is needed and ONCE_REQUIRE_SERVERS=1, but no broker could be started: %v", err)
	}
	t.Skipf("no Apache Kafka broker (set ONCE_REQUIRE_SERVERS=1 to fail instead): %v", err)
}
