package kafka

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// A tombstone (a record with a null value, which a compacted topic uses
// to delete its key) fails the default JSON decoding and is dead-lettered
// as poison, its key kept; a Decoder that takes an empty value as the
// zero payload hands it to the handler, which tells it by its nil
// Message.Value and the key, as docs/kafka.md shows.
func TestTombstones(t *testing.T) {
	for _, tc := range []struct {
		name    string
		decoder consumer.Decoder
	}{{"default decoder", nil}, {"decoder taking tombstones", tombstoneDecoder}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t)
			topic, group := uniq("accounts"), uniq("g")
			c.createTopic(topic, 1)
			db, _ := pgtest.Schema(t)
			_, err := db.Exec(context.Background(), `CREATE TABLE deleted (key text NOT NULL)`)
			require.NoError(t, err)
			src, err := Open(t.Context(), c.config(group, topic))
			require.NoError(t, err)
			cfg := consumerConfig("svc")
			cfg.Decoder = tc.decoder
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
				if ev.Message.Value == nil {
					_, err := tx.Exec(ctx, `INSERT INTO deleted (key) VALUES ($1)`, string(ev.Message.Key))
					return err
				}
				return nil
			}
			r := startConsumer(t, db, src, cfg, h)
			c.produce(&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("acct-7")}) // a null value
			require.Eventually(t, func() bool {
				st := r.c.Stats()
				return st.Handled+st.DeadLettered == 1
			}, 30*time.Second, 10*time.Millisecond)
			require.NoError(t, r.stop())
			var deleted int
			require.NoError(t, db.QueryRow(context.Background(), `SELECT count(*) FROM deleted WHERE key = 'acct-7'`).Scan(&deleted))
			if tc.decoder == nil {
				assert.Equal(t, uint64(1), r.c.Stats().DeadLettered, "dead-lettered as poison")
				dl := c.readAll(topic + ".dlq")
				require.Len(t, dl, 1)
				assert.Equal(t, "acct-7", string(dl[0].Key))
				assert.Zero(t, deleted)
			} else {
				assert.Equal(t, uint64(1), r.c.Stats().Handled)
				assert.Equal(t, 1, deleted, "the handler saw the tombstone")
			}
		})
	}
}

// tombstoneDecoder is consumer.JSON, but takes an empty value (a Kafka
// tombstone) as the zero payload.
func tombstoneDecoder(data []byte, v any) error {
	if len(data) == 0 {
		return nil
	}
	return consumer.JSON(data, v)
}
