package kafkatest_test

import (
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/kafkatest"
)

// Without a fetched release a test needing Apache Kafka is skipped, or,
// under ONCE_REQUIRE_SERVERS=1 (make test), fails saying how to fetch it.
// The test runs this binary as a child with an empty cache directory.
func TestMissingBrokerSkipsOrFails(t *testing.T) {
	if os.Getenv("KAFKATEST_CHILD") == "1" {
		kafkatest.Shared(t)
		t.Log("unreachable: Shared returned without a broker")
		return
	}
	run := func(require string) (string, error) {
		cmd := exec.Command(os.Args[0], "-test.run", "^TestMissingBrokerSkipsOrFails$", "-test.v")
		cmd.Env = append(os.Environ(), "KAFKATEST_CHILD=1", "ONCE_KAFKA_LIBS=", "ONCE_CACHE_DIR="+t.TempDir(),
			"ONCE_REQUIRE_SERVERS="+require)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := run("")
	require.NoError(t, err, out)
	assert.Contains(t, out, "--- SKIP")
	assert.Contains(t, out, "scripts/kafka.sh fetch")

	out, err = run("1")
	require.Error(t, err, out)
	assert.Contains(t, out, "--- FAIL")
	assert.Contains(t, out, "ONCE_REQUIRE_SERVERS=1")
	assert.Contains(t, out, "scripts/kafka.sh fetch")
	assert.NotContains(t, out, "unreachable")
}
