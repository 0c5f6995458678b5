package kafkaout

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/outbox"
)

// A base configuration tuned for a batching producer (Flush.Messages or
// Flush.Bytes, shared with the service's own producers for TLS and SASL)
// held a relay batch smaller than the trigger until Flush.Frequency, or
// for ever without one: every Publish ran to its PublishTimeout, was taken
// for the broker's failure and retried, and the outbox's last rows were
// never published. The publisher sends each batch at once, whatever the
// base's flush triggers.
func TestBatchingBaseConfigPublishesASmallBatchAtOnce(t *testing.T) {
	for name, set := range map[string]func(*sarama.Config){
		"Messages without Frequency": func(c *sarama.Config) { c.Producer.Flush.Messages = 1000 },
		"Bytes with a long Frequency": func(c *sarama.Config) {
			c.Producer.Flush.Bytes = 1 << 20
			c.Producer.Flush.Frequency = time.Hour
		},
	} {
		t.Run(name, func(t *testing.T) {
			kf, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
			require.NoError(t, err)
			defer kf.Close()
			base := sarama.NewConfig()
			base.Version = sarama.V2_8_0_0
			set(base)
			want := base.Producer.Flush
			p, err := New(Config{Brokers: kf.ListenAddrs(), Sarama: base})
			require.NoError(t, err)
			defer p.Close()
			recs := make([]outbox.Record, 3)
			for i := range recs {
				recs[i] = outbox.Record{EventID: fmt.Sprintf("e-%d", i), Topic: "orders", Key: []byte("k"), Body: []byte("b")}
			}
			// Far longer than a publish takes here, far shorter than the
			// hour a held batch waited.
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			errs := p.Publish(ctx, recs)
			assert.Nil(t, errs, "the batch is confirmed: %v", errs)
			assert.Equal(t, want, base.Producer.Flush, "the caller's configuration is not modified")
		})
	}
}
