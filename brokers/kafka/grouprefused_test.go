package kafka

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// A join that the group coordinator refuses because of the group's other
// members (the brokers' group.max.size reached, or no rebalance strategy
// in common) leaves the member consuming nothing for as long as they
// stay: it is retried, as it clears once they leave, but logged as an
// error naming the cause and its fix, not as one more warning among the
// rebalances'.
func TestAGroupRefusalIsLoggedAsSuch(t *testing.T) {
	for _, tc := range []struct {
		name     string
		opts     []kfake.Opt
		strategy sarama.BalanceStrategy // the other member's
		want     string
		reason   string // the counter's error.type
	}{{
		name:     "group max size reached",
		opts:     []kfake.Opt{kfake.BrokerConfigs(map[string]string{"group.max.size": "1"})},
		strategy: sarama.NewBalanceStrategyRange(),
		want:     "group.max.size",
		reason:   "group_max_size_reached",
	}, {
		name:     "no strategy in common",
		strategy: sarama.NewBalanceStrategyRoundRobin(), // the Source's is range
		want:     "GroupStrategies",
		reason:   "inconsistent_group_protocol",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, append(tc.opts, kfake.SeedTopics(1, "orders", "orders.dlq"))...)
			c.produce(&sarama.ProducerMessage{Topic: "orders", Value: sarama.StringEncoder(`{}`)})
			leave := joinOtherMember(t, c, "g", "orders", tc.strategy)

			errs := &errorLines{lines: make(chan string, 1)}
			cfg := c.config("g", "orders")
			cfg.ReconnectMinBackoff, cfg.ReconnectMaxBackoff = 10*time.Millisecond, 100*time.Millisecond
			cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(errs, testLogWriter()), nil))
			reader := sdkmetric.NewManualReader()
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
			t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
			cfg.MeterProvider = mp
			src := c.open(cfg)
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			got := receiveAside(ctx, src) // joins the group
			select {
			case line := <-errs.lines:
				assert.Contains(t, line, tc.want, "the error names the cause")
			case <-ctx.Done():
				t.Fatalf("the refusal was not logged as an error")
			}
			assert.Positive(t, joinsRefused(t, reader)[tc.reason], "the refusal is counted: %v", joinsRefused(t, reader))

			leave()
			r := <-got
			require.NoError(t, r.err, "the member joins once the other leaves")
			require.NoError(t, r.d.Ack(ctx))
		})
	}
}

// joinsRefused returns the GroupRefusedMetricName counter's values by
// error.type.
func joinsRefused(t testing.TB, reader *sdkmetric.ManualReader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == GroupRefusedMetricName {
				for _, dp := range sum.DataPoints {
					reason, _ := dp.Attributes.Value("error.type")
					out[reason.AsString()] += dp.Value
				}
			}
		}
	}
	return out
}

// errorLines passes on the first log line of level ERROR about the group
// coordinator refusing the member.
type errorLines struct {
	once  sync.Once
	lines chan string
}

func (e *errorLines) Write(p []byte) (int, error) {
	if line := string(p); strings.Contains(line, "level=ERROR") && strings.Contains(line, "group coordinator refuses") {
		e.once.Do(func() { e.lines <- line })
	}
	return len(p), nil
}

// joinOtherMember starts a plain sarama member of group, consuming topic
// with strategy and handling nothing, and returns once it holds its
// partitions. The returned function makes it leave the group.
func joinOtherMember(t *testing.T, c *cluster, group, topic string, strategy sarama.BalanceStrategy) (leave func()) {
	t.Helper()
	sc := saramaConfig()
	sc.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{strategy}
	g, err := sarama.NewConsumerGroup(c.addrs, group, sc)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	joined := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		h := &idleMember{joined: joined}
		for ctx.Err() == nil {
			_ = g.Consume(ctx, []string{topic}, h)
		}
	}()
	leave = sync.OnceFunc(func() {
		cancel()
		<-done
		_ = g.Close()
	})
	t.Cleanup(leave)
	select {
	case <-joined:
	case <-time.After(30 * time.Second):
		t.Fatalf("the other member did not join")
	}
	return leave
}

// idleMember is a sarama.ConsumerGroupHandler that holds its claims
// without reading them.
type idleMember struct {
	once   sync.Once
	joined chan struct{}
}

func (h *idleMember) Setup(sarama.ConsumerGroupSession) error {
	h.once.Do(func() { close(h.joined) })
	return nil
}

func (h *idleMember) Cleanup(sarama.ConsumerGroupSession) error { return nil }

func (h *idleMember) ConsumeClaim(sess sarama.ConsumerGroupSession, _ sarama.ConsumerGroupClaim) error {
	<-sess.Context().Done()
	return nil
}
