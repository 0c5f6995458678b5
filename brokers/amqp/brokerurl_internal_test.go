package amqp

import (
	"os"
	"testing"
)

// testBrokerURL is the in-package tests' brokerURL (helpers_test.go is
// package amqp_test): AMQP_URL, the test skipped without it, or failed
// under ONCE_REQUIRE_SERVERS=1 (make test), so that a run meant to cover
// the broker never passes without it.
func testBrokerURL(t testing.TB) string {
	t.Helper()
	u := os.Getenv("AMQP_URL")
	if u == "" {
		if os.Getenv("ONCE_REQUIRE_SERVERS") == "1" {
			t.Fatal("AMQP_URL is not set and ONCE_REQUIRE_SERVERS=1: start a broker with scripts/rabbitmq.sh start DIR")
		}
		t.Skip("AMQP_URL is not set")
	}
	return u
}
