package main

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// /healthz says 503 until the consumer runs, then 200 while the database
// answers; /metrics serves the Prometheus text format.
func TestHealthAndMetricsEndpoints(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	tel, err := startTelemetry("127.0.0.1:0", "")
	require.NoError(t, err)
	t.Cleanup(func() { _ = tel.Close() })
	base := "http://" + tel.addr

	code, _ := httpGet(t, base+"/healthz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	tel.pool.Store(pool)
	tel.running.Store(true)
	code, body := httpGet(t, base+"/healthz")
	require.Equal(t, http.StatusOK, code, body)

	counter, err := tel.MeterProvider().Meter("test").Int64Counter("order_processor_test_events")
	require.NoError(t, err)
	counter.Add(context.Background(), 3)
	code, body = httpGet(t, base+"/metrics")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "order_processor_test_events_total")
	require.Contains(t, body, "go_goroutines")
}

// Off a terminal the progress is a log line per interval; on one it is a
// line redrawn in place.
func TestProgressLines(t *testing.T) {
	stats := consumer.Stats{Received: 7, Handled: 5, Duplicates: 1, DeadLettered: 1}
	get := func() consumer.Stats { return stats }

	var log syncBuffer
	p := newProgress(&log, false, 10*time.Millisecond, "run 2:", get)
	require.Eventually(t, func() bool { return strings.Count(log.String(), "\n") >= 2 }, 10*time.Second, 5*time.Millisecond)
	p.Stop()
	out := log.String()
	require.NotContains(t, out, "\r")
	require.Contains(t, out, "run 2: received 7  handled 5  duplicates skipped 1  dead-lettered 1")

	var tty syncBuffer
	p = newProgress(&tty, true, 10*time.Millisecond, "", get)
	require.Eventually(t, func() bool { return strings.Count(tty.String(), "\r\033[K") >= 2 }, 10*time.Second, 5*time.Millisecond)
	p.Stop()
	out = tty.String()
	require.True(t, strings.HasSuffix(out, "\n"), "the final line stays: %q", out)
	require.Equal(t, 1, strings.Count(out, "\n"), "redrawn in place, one final newline: %q", out)
}
