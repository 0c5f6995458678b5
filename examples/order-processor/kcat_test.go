package main

import (
	"context"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// httpGet returns the status and body of url.
func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// A producer we did not write: kcat (librdkafka) produces into the serve
// command's embedded broker, at the address it printed, and the service
// handles those events; /metrics and /healthz answer meanwhile.
func TestKcatProducesToEmbeddedBroker(t *testing.T) {
	kcat, err := exec.LookPath("kcat")
	if err != nil {
		if os.Getenv("ONCE_REQUIRE_SERVERS") == "1" {
			t.Fatal("kcat is not installed and ONCE_REQUIRE_SERVERS=1: apt-get install kcat (scripts/ensure-deps.sh does)")
		}
		t.Skip("kcat is not installed (Debian package kcat)")
	}
	pool, schema := pgtest.Schema(t)
	t.Setenv("DATABASE_URL", pgtest.URL())
	t.Setenv("KAFKA_BROKERS", "")
	t.Setenv("BROKER", "")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errOut syncBuffer
	done := make(chan int, 1)
	go func() {
		done <- realMain(ctx, []string{"serve", "-schema", schema, "-name", "kcat-" + schema, "-metrics-addr", "127.0.0.1:0"}, &out, &errOut)
	}()
	addr := waitMatch(t, &out, regexp.MustCompile(`listening on (127\.0\.0\.1:\d+)`))[1]
	metrics := waitMatch(t, &out, regexp.MustCompile(`metrics: (http://\S+)/metrics`))[1]
	waitMatch(t, &out, regexp.MustCompile(`consuming orders`))

	produce := func(key, value string, headers ...string) {
		t.Helper()
		args := []string{"-b", addr, "-t", "orders", "-P", "-k", key}
		for _, h := range headers {
			args = append(args, "-H", h)
		}
		cmd := exec.Command(kcat, args...)
		cmd.Stdin = strings.NewReader(value + "\n")
		b, err := cmd.CombinedOutput()
		require.NoError(t, err, "kcat: %s", b)
	}
	produce("o-k1", `{"order_id":"o-k1","customer":"kim","amount_cents":1250}`, "id=kc-1", "type=order.created")
	produce("o-k1", `{"order_id":"o-k1","payment_id":"pay-k1","amount_cents":1250}`, "type=order.paid") // no id: derived
	produce("o-k1", `{"order_id":"o-k1","payment_id":"pay-k1","amount_cents":1250}`, "type=order.paid") // the same, republished
	produce("o-k2", `{"order_id":"o-k2","cust`, "id=kc-4", "type=order.created")                        // malformed
	produce("o-k3", `{"order_id":"o-k3"}`, "id=kc-5", "type=order.shipped")                             // nobody handles it

	require.Eventually(t, func() bool {
		_, body := httpGet(t, metrics+"/metrics")
		return strings.Contains(body, `kind="decode"`) && strings.Contains(body, `kind="unknown-type"`) &&
			regexp.MustCompile(`outcome="duplicate"} 1\b`).MatchString(body) &&
			regexp.MustCompile(`outcome="handled"} 2\b`).MatchString(body)
	}, 60*time.Second, 20*time.Millisecond, "metrics never showed the five events:\n%s", errOut.String())
	status, payments, sum := orderState(t, pool, "o-k1")
	require.Equal(t, "paid", status)
	require.Equal(t, 1, payments)
	require.EqualValues(t, 1250, sum)
	code, body := httpGet(t, metrics+"/healthz")
	require.Equal(t, http.StatusOK, code, body)

	cancel()
	select {
	case c := <-done:
		require.Equal(t, 0, c, "stderr:\n%s", errOut.String())
	case <-time.After(30 * time.Second):
		t.Fatal("serve did not stop within 30s of its context being cancelled")
	}
	require.Contains(t, out.String(), "stopped: received 5, handled 2, duplicates skipped 1, dead-lettered 2")
}
