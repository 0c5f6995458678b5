package consumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// The consumer works in every pgx query exec mode, also those without
// prepared statements that a transaction-mode PgBouncer before 1.21 needs
// (QueryExecModeExec, QueryExecModeSimpleProtocol): each handler shape
// (tx.Exec, Event.Queue, a BatchHandler) with duplicates and poison in
// the stream has every effect once and every poison message dead-lettered.
// QueryExecModeCacheStatement, the default, is what every other test runs.
func TestConsumerInEveryQueryExecMode(t *testing.T) {
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		for _, kind := range []string{"exec", "queue", "batch"} {
			t.Run(fmt.Sprint(mode, "/", kind), func(t *testing.T) {
				admin, schema := pgtest.Schema(t)
				effects(t, admin)
				pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
				b := memsource.New(memsource.Options{Streams: 4})
				want := map[string]int{}
				for i := range 300 { // 300 events, every 10th twice, every 7th preceded by poison
					id := fmt.Sprintf("e%d", i)
					if i%7 == 0 {
						b.Publish(consumer.Message{Value: []byte(`{"n":`), Headers: map[string]string{"id": fmt.Sprintf("bad%d", i)}})
					}
					publish(b, id, i)
					if i%10 == 0 {
						publish(b, id, i)
					}
					want[id] = 1
				}
				cfg := fastConfig("modes")
				var c interface{ Stats() consumer.Stats }
				switch kind {
				case "exec":
					cc, err := consumer.New(pool, b.Source(), insertEffect, cfg)
					require.NoError(t, err)
					start(t, cc)
					c = cc
				case "queue":
					cc, err := consumer.New(pool, b.Source(), func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
						ev.Queue(`INSERT INTO effects (event_id, n) VALUES ($1, $2)`, ev.ID, ev.Payload.N)
						return nil
					}, cfg)
					require.NoError(t, err)
					start(t, cc)
					c = cc
				case "batch":
					cc, err := consumer.NewBatch(pool, b.Source(), insertEffects, cfg)
					require.NoError(t, err)
					start(t, cc)
					c = cc
				}
				require.Eventually(t, func() bool { return b.Acked() == 300+30+43 }, 20*time.Second, time.Millisecond, "%+v", c.Stats())
				assert.Equal(t, want, countEffects(t, admin))
				assert.Len(t, b.DeadLetters(), 43)
			})
		}
	}
}
