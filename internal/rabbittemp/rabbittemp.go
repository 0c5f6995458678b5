// Package rabbittemp starts RabbitMQ nodes of a test's own, with the
// project's scripts/rabbitmq.sh, for tests that change a node's settings
// or stop it: the node make test shares between packages must not be
// disturbed.
package rabbittemp

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Node is a RabbitMQ node started by Start.
type Node struct {
	// URL is its AMQP URL (guest:guest), Name its Erlang node name and
	// Dir the directory of its files (and Erlang cookie).
	URL, Name, Dir string
}

// Installed reports whether rabbitmq-server is installed.
func Installed() bool {
	for _, p := range []string{"/usr/lib/rabbitmq/bin/rabbitmq-server", "/usr/sbin/rabbitmq-server"} {
		if _, err := os.Stat(p); err == nil {
			return true
		}
	}
	_, err := exec.LookPath("rabbitmq-server")
	return err == nil
}

// Start starts a node for t alone with script (the path of
// scripts/rabbitmq.sh) and stops it when t ends. It skips t where RabbitMQ
// is not installed, and fails it then under ONCE_REQUIRE_SERVERS=1 (make
// test installs it).
func Start(t testing.TB, script string) Node {
	t.Helper()
	if !Installed() {
		if os.Getenv("ONCE_REQUIRE_SERVERS") == "1" {
			t.Fatal("rabbitmq-server is not installed and ONCE_REQUIRE_SERVERS=1: scripts/ensure-deps.sh rabbitmq")
		}
		t.Skip("rabbitmq-server is not installed: this test starts a node of its own")
	}
	dir, err := os.MkdirTemp("", "once-rabbit-test-")
	require.NoError(t, err)
	var stderr strings.Builder
	cmd := exec.Command(script, "start", dir)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	t.Cleanup(func() {
		if out, err := exec.Command(script, "stop", dir).CombinedOutput(); err != nil {
			t.Logf("rabbitmq.sh stop: %v: %s", err, out)
		}
	})
	require.NoError(t, err, "rabbitmq.sh start: %s", stderr.String())
	env := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		k, v, ok := strings.Cut(strings.TrimPrefix(line, "export "), "=")
		require.True(t, ok, "rabbitmq.sh start printed %q", line)
		env[k] = v
	}
	n := Node{URL: env["AMQP_URL"], Name: env["ONCE_RABBITMQ_NODE"], Dir: env["ONCE_RABBITMQ_DIR"]}
	require.NotEmpty(t, n.URL)
	require.NotEmpty(t, n.Name)
	require.Equal(t, dir, n.Dir)
	return n
}

// Ctl runs rabbitmqctl against the node and returns its output; a failure
// fails t.
func (n Node) Ctl(t testing.TB, args ...string) string {
	t.Helper()
	bin := "/usr/lib/rabbitmq/bin/rabbitmqctl" // the /usr/sbin wrapper switches to the rabbitmq user when root
	if _, err := os.Stat(bin); err != nil {
		bin = "rabbitmqctl"
	}
	cmd := exec.Command(bin, append([]string{"-n", n.Name}, args...)...)
	cmd.Env = append(os.Environ(), "HOME="+n.Dir) // the node's Erlang cookie
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "rabbitmqctl %s: %s", strings.Join(args, " "), out)
	return string(out)
}
