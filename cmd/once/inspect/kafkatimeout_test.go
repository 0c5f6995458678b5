package inspect_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/onceco/once/cmd/once/inspect"
	"github.com/onceco/once/cmd/once/internal/testenv"
)

// KafkaLag with no sarama configuration (sc nil) bounds the dial and each
// request as the once command does by default: a broker that accepts
// connections and never answers fails it within about half a minute,
// saying that the broker did not answer within 8s, instead of holding it
// for minutes on sarama's own timeouts and retries.
func TestKafkaLagOnABrokerThatNeverAnswersFailsWithinTheDefaultTimeout(t *testing.T) {
	err := testenv.FailsAgainstSilentBroker(t, func(ctx context.Context, addr string) error {
		_, err := inspect.KafkaLag(ctx, []string{addr}, nil, "billing", []string{"orders"})
		return err
	})
	t.Log(err)
	assert.Contains(t, err.Error(), "did not answer within 8s")
}
