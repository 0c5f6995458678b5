package kafkarefusal

import (
	"context"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
)

// A broker that needs no SASL and answers a SASL handshake anyway (kfake
// does) is not taken for one that asks for SASL: the client's own
// requests are answered.
func TestProbeFindsNoRefusalAtAHealthyBroker(t *testing.T) {
	kf, err := kfake.NewCluster(kfake.NumBrokers(1))
	require.NoError(t, err)
	t.Cleanup(kf.Close)
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_8_0_0
	assert.Nil(t, Probe(context.Background(), kf.ListenAddrs(), sc))
}
