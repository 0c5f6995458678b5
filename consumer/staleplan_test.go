package consumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// A migration that changes the type of a column a handler reads (here
// text to varchar) leaves every pooled connection with a cached plan
// PostgreSQL refuses to run again: "cached plan must not change result
// type" (0A000), once per connection, after which pgx prepares the
// statement anew. That was taken for the handler's own failure and
// counted against Retry.MaxAttempts, so a message whose attempts met
// stale connections was dead-lettered for a routine schema change (here,
// with MaxAttempts 1, the first message on each connection). It is
// infrastructure: the message is retried, the connection that met it is
// closed (a statement the handler prepared by name, which pgx keeps,
// would fail on it again and again), and every message is handled once.
func TestColumnTypeChangedUnderARunningConsumerIsNoPoison(t *testing.T) {
	for _, how := range []string{"tx.QueryRow", "Event.Queue", "tx.Prepare"} {
		t.Run(how, func(t *testing.T) {
			admin, schema := pgtest.Schema(t)
			effects(t, admin)
			ctx := context.Background()
			_, err := admin.Exec(ctx, `CREATE TABLE orders (id int PRIMARY KEY, status text NOT NULL);
				INSERT INTO orders SELECT g, 'new' FROM generate_series(0, 99) g`)
			require.NoError(t, err)
			pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.MaxConns = 16 })
			b := memsource.New(memsource.Options{Streams: 16})
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				const read = `SELECT status FROM orders WHERE id = $1`
				var status string
				switch how {
				case "Event.Queue":
					ev.Queue(read, ev.Payload.N).QueryRow(func(r pgx.Row) error { return r.Scan(&status) })
				case "tx.Prepare":
					if _, err := tx.Prepare(ctx, "read_status", read); err != nil {
						return err
					}
					if err := tx.QueryRow(ctx, "read_status", ev.Payload.N).Scan(&status); err != nil {
						return err
					}
				default:
					if err := tx.QueryRow(ctx, read, ev.Payload.N).Scan(&status); err != nil {
						return err
					}
				}
				return insertEffect(ctx, tx, ev)
			}
			cfg := fastConfig("stale-plan")
			cfg.Retry.MaxAttempts = 1
			cfg.Batch.Size = 1
			c, err := consumer.New(pool, b.Source(), h, cfg)
			require.NoError(t, err)
			start(t, c)
			want := map[string]int{}
			run := func(prefix string) {
				for i := range 400 {
					id := fmt.Sprintf("%s%d", prefix, i)
					publish(b, id, i%100)
					want[id] = 1
				}
				require.Eventually(t, func() bool { return b.Acked() == len(want) }, 30*time.Second, time.Millisecond)
			}
			run("before-") // every connection has the statement prepared
			_, err = admin.Exec(ctx, `ALTER TABLE orders ALTER COLUMN status TYPE varchar(100)`)
			require.NoError(t, err)
			run("after-")
			assert.Empty(t, deadLetterKinds(b), "no message dead-lettered for a plan the schema change made stale")
			assert.Equal(t, want, countEffects(t, admin))
		})
	}
}

func TestClassifyStaleCachedPlan(t *testing.T) {
	stale := &pgconn.PgError{Code: "0A000", Message: "cached plan must not change result type", Routine: "RevalidateCachedQuery"}
	assert.Equal(t, consumer.ClassInfrastructure, consumer.Classify(fmt.Errorf("select: %w", stale)))
	assert.True(t, consumer.IsTransient(stale))
	other := &pgconn.PgError{Code: "0A000", Message: "FOR UPDATE is not allowed with aggregate functions", Routine: "CheckSelectLocking"}
	assert.Equal(t, consumer.ClassRetry, consumer.Classify(other), "another feature_not_supported is the statement's own")
	assert.False(t, consumer.IsTransient(other))
}
