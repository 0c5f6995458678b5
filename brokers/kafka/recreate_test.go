package kafka

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// idless returns n records without an id header: the consumer identifies
// them by the adapter's fallback id.
func idless(topic string, from, n int) []*sarama.ProducerMessage {
	out := make([]*sarama.ProducerMessage, 0, n)
	for i := from; i < from+n; i++ {
		v, _ := json.Marshal(event{N: i})
		out = append(out, &sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(v)})
	}
	return out
}

// A topic deleted and created again while the group is stopped starts its
// offsets at 0 again. Records without an id header are identified by the
// fallback id, which includes the topic's id (Kafka 2.8+), so the new
// topic's records are new events, not duplicates of the old topic's
// records at the same offsets.
func TestRecreatedTopicRecordsAreNotDuplicates(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		c := newClusterOf(t, kind)
		topic, group := uniq("orders"), uniq("g")
		c.createTopic(topic, 1)
		db, _ := pgtest.Schema(t)
		_, err := db.Exec(context.Background(), effectsTable)
		require.NoError(t, err)

		run := func(want int) {
			src, err := Open(t.Context(), c.config(group, topic))
			require.NoError(t, err)
			r := startConsumer(t, db, src, consumerConfig("orders-svc"), recordEffect)
			require.Eventually(t, func() bool {
				st := r.c.Stats()
				return st.Received >= 5 && st.Received == st.Handled+st.Duplicates+st.Skipped
			}, 30*time.Second, 10*time.Millisecond)
			require.NoError(t, r.stop())
			st := r.c.Stats()
			t.Logf("stats %+v", st)
			assert.Equal(t, uint64(5), st.Handled, "every record of this topic's life is a new event")
			assert.Zero(t, st.Duplicates)
			var rows int
			require.NoError(t, db.QueryRow(context.Background(), `SELECT count(*) FROM effects`).Scan(&rows))
			assert.Equal(t, want, rows)
		}
		c.produceHashed(idless(topic, 0, 5))
		run(5)

		c.deleteTopic(topic)
		c.createTopic(topic, 1)
		c.produceHashed(idless(topic, 100, 5))
		run(10)
		var distinct int
		require.NoError(t, db.QueryRow(context.Background(), `SELECT count(DISTINCT n) FROM effects`).Scan(&distinct))
		assert.Equal(t, 10, distinct, "the second life's records (n 100..104) have their effects")
	})
}
