package kafka

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/internal/netcut"
)

// A topic id is looked up for every partition claimed. When the connections
// of the client it goes through are cut, the next lookup must still answer:
// it once went through a connection of the client's that stayed broken, so
// every later claim waited for its topic id until the session ended and the
// partition was claimed but never fetched (a chaos run that never drained).
func TestTopicIDLookupSurvivesACut(t *testing.T) {
	var ln *netcut.Listener
	c := newCluster(t, kfake.ListenFn(func(network, addr string) (net.Listener, error) {
		inner, err := net.Listen(network, addr)
		if err != nil {
			return nil, err
		}
		ln = &netcut.Listener{Listener: inner}
		return ln, nil
	}))
	topic := uniq("orders")
	c.createTopic(topic, 1)
	client, err := sarama.NewClient(c.addrs, saramaConfig())
	require.NoError(t, err)
	t.Cleanup(func() { _ = client.Close() })
	ids := topicIDs{client: client, version: saramaConfig().Version}

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	first, err := ids.lookup(ctx, topic)
	require.NoError(t, err)
	require.NotEmpty(t, first, "kfake has topic ids")
	require.Positive(t, ln.Cut(), "connections were open to cut")
	again, err := ids.lookup(ctx, topic)
	require.NoError(t, err, "the lookup after a cut answers before its deadline")
	require.Equal(t, first, again)
}
