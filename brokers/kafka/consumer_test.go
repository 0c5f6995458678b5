package kafka

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/pgtest"
)

// event is the payload the end-to-end tests publish.
type event struct {
	N int `json:"n"`
}

// events returns n records for topic with ids prefix-0.. and an "id" header,
// spread over partitions by key.
func events(topic, prefix string, from, n int) []*sarama.ProducerMessage {
	out := make([]*sarama.ProducerMessage, 0, n)
	for i := from; i < from+n; i++ {
		v, _ := json.Marshal(event{N: i})
		out = append(out, &sarama.ProducerMessage{
			Topic:   topic,
			Key:     sarama.StringEncoder(fmt.Sprintf("key-%d", i%16)),
			Value:   sarama.ByteEncoder(v),
			Headers: []sarama.RecordHeader{{Key: []byte("id"), Value: []byte(fmt.Sprintf("%s-%d", prefix, i))}},
		})
	}
	return out
}

// produceHashed writes msgs with the hash partitioner (records of one key
// on one partition).
func (c *cluster) produceHashed(msgs []*sarama.ProducerMessage) {
	c.t.Helper()
	require.NoError(c.t, produceHashed(c.addrs, msgs))
}

func produceHashed(addrs []string, msgs []*sarama.ProducerMessage) error {
	sc := saramaConfig()
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	// Idempotent, as cluster.producer: a produce retried under load (the
	// whole package's tests at once) wrote a record twice, and a record
	// without an id is an event by its offset: its copy was a second event
	// with the same payload, handled as such (TestOffsetsInDatabase-
	// SurviveLostGroupOffsets saw 41 events of 40 once).
	sc.Producer.Idempotent = true
	sc.Net.MaxOpenRequests = 1
	p, err := sarama.NewSyncProducer(addrs, sc)
	if err != nil {
		return err
	}
	defer p.Close()
	return p.SendMessages(msgs)
}

const effectsTable = `CREATE TABLE effects (event_id text NOT NULL, n int NOT NULL)`

// effectsDB returns a pool on a schema of the test's own holding the
// effects table recordEffect writes to.
func effectsDB(t testing.TB) *pgxpool.Pool {
	t.Helper()
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	return db
}

// recordEffect is a handler writing one business row per event in the
// handler's transaction.
func recordEffect(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, n) VALUES ($1, $2)`, ev.ID, ev.Payload.N)
	return err
}

// effectCounts returns the number of business rows per event id.
func effectCounts(t testing.TB, db *pgxpool.Pool) map[string]int {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT event_id, count(*) FROM effects GROUP BY event_id`)
	require.NoError(t, err)
	got := map[string]int{}
	var id string
	var n int
	_, err = pgx.ForEachRow(rows, []any{&id, &n}, func() error { got[id] = n; return nil })
	require.NoError(t, err)
	return got
}

// requireExactlyOnce asserts one business row per id of prefix-0..n-1 and
// nothing else.
func requireExactlyOnce(t testing.TB, db *pgxpool.Pool, prefix string, n int) {
	t.Helper()
	want := make(map[string]int, n)
	for i := range n {
		want[fmt.Sprintf("%s-%d", prefix, i)] = 1
	}
	require.Equal(t, want, effectCounts(t, db), "each event's effect exactly once, nothing lost")
}

// waitEffects waits until n distinct events have their business row.
func waitEffects(t testing.TB, db *pgxpool.Pool, n int, within time.Duration) {
	t.Helper()
	require.Eventually(t, func() bool { return len(effectCounts(t, db)) >= n }, within, 20*time.Millisecond,
		"want the effects of %d events", n)
}

// runningConsumer is a consumer.Consumer running in the background.
type runningConsumer struct {
	c    *consumer.Consumer[event]
	stop func() error
}

func startConsumer(t testing.TB, db *pgxpool.Pool, src consumer.Source, cfg consumer.Config, h consumer.Handler[event]) *runningConsumer {
	t.Helper()
	c, err := consumer.New(db, src, h, cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	var runErr error
	stop := func() error {
		once.Do(func() { cancel(); runErr = <-done })
		return runErr
	}
	t.Cleanup(func() { _ = stop() })
	return &runningConsumer{c: c, stop: stop}
}

func consumerConfig(name string) consumer.Config {
	return consumer.Config{
		Name:         name,
		Retry:        consumer.RetryPolicy{MaxAttempts: 3, InitialBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond},
		InfraBackoff: consumer.Backoff{Initial: 10 * time.Millisecond, Max: 500 * time.Millisecond},
		Telemetry:    consumer.TelemetryConfig{Logger: testLogger()},
	}
}
