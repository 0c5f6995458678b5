package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
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

func TestMain(m *testing.M) { pgtest.Main(m) }

type order struct {
	N int `json:"n"`
}

// effects is a business table: one row per handler effect (no unique key,
// so a double effect shows as two rows).
func effects(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `CREATE TABLE effects (event_id text NOT NULL, n int NOT NULL, seq bigserial)`)
	require.NoError(t, err)
}

func insertEffect(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, n) VALUES ($1, $2)`, ev.ID, ev.Payload.N)
	return err
}

func countEffects(t *testing.T, pool *pgxpool.Pool) map[string]int {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT event_id, count(*) FROM effects GROUP BY event_id`)
	require.NoError(t, err)
	got := map[string]int{}
	var id string
	var n int
	_, err = pgx.ForEachRow(rows, []any{&id, &n}, func() error { got[id] = n; return nil })
	require.NoError(t, err)
	return got
}

// requireEffectsOnce checks that exactly want events have an effect, each
// exactly once, and returns the effects by event id.
func requireEffectsOnce(t *testing.T, pool *pgxpool.Pool, want int) map[string]int {
	t.Helper()
	got := countEffects(t, pool)
	require.Len(t, got, want, "events with an effect")
	for id, n := range got {
		require.Equal(t, 1, n, "double effect for %s", id)
	}
	return got
}

// publishKeyed publishes an order with id under key (which picks its
// stream).
func publishKeyed(b *memsource.Broker, key, id string, n int) {
	v, _ := json.Marshal(order{N: n})
	b.Publish(consumer.Message{Value: v, Headers: map[string]string{"id": id}, Key: []byte(key)})
}

// keyOnAnotherStream returns a key, starting with prefix, whose stream
// among n differs from key's.
func keyOnAnotherStream(key, prefix string, n int) string {
	other := prefix
	for i := 0; memStream(other, n) == memStream(key, n); i++ {
		other = fmt.Sprintf("%s%d", prefix, i)
	}
	return other
}

// commitLog records, as Hooks.AfterCommit, the event ids of each committed
// transaction.
type commitLog struct {
	mu  sync.Mutex
	txs [][]string
}

func (l *commitLog) hook(_ context.Context, evs []consumer.Committed) {
	ids := make([]string, len(evs))
	for i, ev := range evs {
		ids[i] = ev.EventID
	}
	l.mu.Lock()
	l.txs = append(l.txs, ids)
	l.mu.Unlock()
}

func (l *commitLog) transactions() [][]string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.txs)
}

func publish(b *memsource.Broker, id string, n int) {
	v, _ := json.Marshal(order{N: n})
	b.Publish(consumer.Message{Value: v, Headers: map[string]string{"id": id}, Key: []byte(id)})
}

// start runs c until the test ends or stop is called; stop returns Run's error.
func start[T any](t *testing.T, c *consumer.Consumer[T]) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() { cancel(); err = <-done })
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

func fastConfig(name string) consumer.Config {
	return consumer.Config{
		Name:         name,
		Retry:        consumer.RetryPolicy{MaxAttempts: 3, InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond},
		InfraBackoff: consumer.Backoff{Initial: 5 * time.Millisecond, Max: 50 * time.Millisecond},
	}
}

func TestDuplicatesHaveOneEffect(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 4})
	for i := 0; i < 50; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
		publish(b, fmt.Sprintf("e%d", i), i) // redelivered copy
	}
	c, err := consumer.New(pool, b.Source(), insertEffect, fastConfig("dups"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 100 }, 10*time.Second, 5*time.Millisecond)
	requireEffectsOnce(t, pool, 50)
	st := c.Stats()
	assert.Equal(t, uint64(50), st.Handled)
	assert.Equal(t, uint64(50), st.Duplicates)
}

func TestHandlerErrorRollsBackClaimAndEffect(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{})
	publish(b, "flaky", 1)
	var calls int
	var mu sync.Mutex
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if err := insertEffect(ctx, tx, ev); err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		calls++
		if calls < 3 {
			return errors.New("not yet")
		}
		return nil
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("flaky"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, map[string]int{"flaky": 1}, countEffects(t, pool), "the two failed attempts' rows must be rolled back")
	assert.Equal(t, uint64(2), c.Stats().Retries)
	assert.Empty(t, b.DeadLetters())
}

// A handler that swallows the error of a failed statement leaves its
// batch's transaction aborted: the failure is that handler's, not that of
// a later handler whose statements then fail ("current transaction is
// aborted"). With Retry.MaxAttempts 1, that later event was dead-lettered
// with the other's failure, though its handler was sound.
func TestSwallowedStatementErrorIsChargedToItsHandler(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publishKeyed(b, "k", "before", 0)
	publishKeyed(b, "k", "swallower", 1)
	publishKeyed(b, "k", "after", 2)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.ID == "swallower" {
			_, _ = tx.Exec(ctx, `SELECT 1/0`) // the error is dropped
			return nil
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("swallowed")
	cfg.Retry.MaxAttempts = 1
	cfg.Batch.Size = 3
	cfg.Batch.Linger = time.Minute // one batch of all three
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	wctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(wctx, 3))
	require.NoError(t, stop())
	assert.Equal(t, map[string]string{"swallower": string(consumer.KindHandler)}, deadLetterKinds(b))
	assert.Equal(t, map[string]int{"before": 1, "after": 1}, countEffects(t, pool))
}

// Every run of a handler gets the payload as the message holds it: a
// handler that changes its payload in place (a pointer payload, a map in
// it) and then fails, or whose batch is rolled back and run again for
// another message's failure, does not see its own change on the next run,
// which would commit the change twice.
func TestEachRunGetsThePayloadAsTheMessageHoldsIt(t *testing.T) {
	type tagged struct {
		N    int               `json:"n"`
		Tags map[string]string `json:"tags"`
	}
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	b.Publish(consumer.Message{ID: "retried", Key: []byte("k"), Value: []byte(`{"n":1,"tags":{}}`)})
	var runs atomic.Int32
	var seen sync.Map // run -> the tag count the run found
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[*tagged]) error {
		run := runs.Add(1)
		seen.Store(run, len(ev.Payload.Tags))
		ev.Payload.N *= 10 // e.g. an amount converted in place
		ev.Payload.Tags[fmt.Sprint("run", run)] = "x"
		if _, err := tx.Exec(ctx, `INSERT INTO effects (event_id, n) VALUES ($1, $2)`, ev.ID, ev.Payload.N); err != nil {
			return err
		}
		if run == 1 {
			return errors.New("a dependency failed after the write") // rolled back, retried
		}
		return nil
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("payload-per-run"))
	require.NoError(t, err)
	stop := start(t, c)
	wctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(wctx, 1))
	require.NoError(t, stop())
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT n FROM effects WHERE event_id = 'retried'`).Scan(&n))
	assert.Equal(t, 10, n, "the amount converted once")
	second, _ := seen.Load(int32(2))
	assert.Equal(t, 0, second, "the second run saw no tag of the first")
}

// A handler that returns with the rows of a query left open (it read the
// first row and never closed them) leaves its transaction's connection
// busy: that is its failure, retried and then dead-lettered, and the
// messages around it go on (was: the COMMIT, or the next handler's
// statement, failed with "conn busy", retried as an infrastructure
// failure without end, or charged to the next message of the batch).
func TestRowsLeftOpenAreTheHandlersFailure(t *testing.T) {
	for _, batch := range []int{1, 3} {
		t.Run(fmt.Sprint("batch ", batch), func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			publishKeyed(b, "k", "before", 0)
			publishKeyed(b, "k", "leaker", 1)
			publishKeyed(b, "k", "after", 2)
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				if ev.ID == "leaker" {
					rows, err := tx.Query(ctx, `SELECT generate_series(1, 10)`)
					if err != nil {
						return err
					}
					rows.Next() // the first row only; rows never closed
					return nil
				}
				return insertEffect(ctx, tx, ev)
			}
			cfg := fastConfig("rows-left-open")
			cfg.Batch.Size = batch
			cfg.Batch.Linger = time.Minute // the whole backlog in batches of batch
			c, err := consumer.New(pool, b.Source(), h, cfg)
			require.NoError(t, err)
			stop := start(t, c)
			wctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			require.NoError(t, b.WaitAcked(wctx, 3), "infrastructure failures: %d", c.Stats().InfraErrors)
			require.NoError(t, stop())
			assert.Equal(t, map[string]string{"leaker": string(consumer.KindHandler)}, deadLetterKinds(b))
			assert.Equal(t, map[string]int{"before": 1, "after": 1}, countEffects(t, pool))
			assert.Zero(t, c.Stats().InfraErrors)
		})
	}
}
