package dlq_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/internal/testenv"
)

// A KafkaQueue built without a sarama configuration (KafkaConfig.Sarama
// nil) bounds the dial and each request as the once command does by
// default: a read of a broker that accepts connections and never answers
// (a port that is not Kafka's, a hung broker, a firewall) fails within
// about half a minute, saying that the broker did not answer within 8s,
// instead of waiting out sarama's own timeouts and retries for minutes.
func TestKafkaThatNeverAnswersFailsWithinTheDefaultTimeout(t *testing.T) {
	for name, call := range map[string]func(context.Context, *dlq.KafkaQueue) error{
		"browse": func(ctx context.Context, q *dlq.KafkaQueue) error {
			return q.Browse(ctx, func(*dlq.Record) error { return nil })
		},
		"replay": func(ctx context.Context, q *dlq.KafkaQueue) error {
			_, err := q.Replay(ctx, dlq.Filter{}, dlq.ReplayOptions{})
			return err
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			err := testenv.FailsAgainstSilentBroker(t, func(ctx context.Context, addr string) error {
				q, err := dlq.NewKafka(dlq.KafkaConfig{Brokers: []string{addr}, Topic: "orders.dlq"})
				require.NoError(t, err)
				return call(ctx, q)
			})
			t.Log(err)
			assert.Contains(t, err.Error(), "did not answer within 8s")
		})
	}
}
