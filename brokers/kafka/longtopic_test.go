package kafka

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// A record without an id is identified by its position, topic/partition/
// offset@topic-id. Kafka names a topic with up to 249 characters, so on a
// long-named topic that position is longer than Identify.MaxIDLength's
// default of 256 bytes: every id-less record was dead-lettered as
// KindInvalidID. MaxIDLength bounds the ids events carry; the position is
// the adapter's own, bounded by Kafka, and is taken whole.
func TestRecordsWithoutIDOnALongNamedTopicAreHandled(t *testing.T) {
	c := newCluster(t)
	topic := uniq(strings.Repeat("t", 236)) // 240 characters with uniq's suffix, its .dlq 244
	group := uniq("g")
	c.createTopic(topic, 1)
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), `CREATE TABLE seen (id text NOT NULL)`)
	require.NoError(t, err)
	src, err := Open(t.Context(), c.config(group, topic))
	require.NoError(t, err)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
		_, err := tx.Exec(ctx, `INSERT INTO seen (id) VALUES ($1)`, ev.ID)
		return err
	}
	r := startConsumer(t, db, src, consumerConfig("svc"), h)
	c.produce(&sarama.ProducerMessage{Topic: topic, Value: sarama.StringEncoder(`{"n":1}`)},
		&sarama.ProducerMessage{Topic: topic, Value: sarama.StringEncoder(`{"n":2}`)})
	require.Eventually(t, func() bool {
		st := r.c.Stats()
		return st.Handled+st.DeadLettered == 2
	}, 30*time.Second, 10*time.Millisecond)
	require.NoError(t, r.stop())
	assert.Equal(t, uint64(2), r.c.Stats().Handled, "handled, not dead-lettered")
	var ids []string
	rows, err := db.Query(context.Background(), `SELECT id FROM seen ORDER BY id`)
	require.NoError(t, err)
	ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Len(t, ids, 2)
	for _, id := range ids {
		assert.Greater(t, len(id), 256, "the position, whole")
		assert.True(t, strings.HasPrefix(id, topic+"/0/"), id)
	}
}
