package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
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

const insertEffectSQL = `INSERT INTO effects (event_id, n) VALUES ($1, $2)`

func queueEffect(_ context.Context, _ pgx.Tx, ev consumer.Event[order]) error {
	ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N)
	return nil
}

// statementTracer counts, per SQL text, the statements sent on their own
// and those sent in a batch.
type statementTracer struct {
	mu      sync.Mutex
	alone   map[string]int
	batched map[string]int
}

func (s *statementTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.alone[d.SQL]++
	return ctx
}

func (s *statementTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (s *statementTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, q := range d.Batch.QueuedQueries {
		s.batched[q.SQL]++
	}
	return ctx
}

func (s *statementTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (s *statementTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

func (s *statementTracer) counts(sql string) (alone, batched int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.alone[sql], s.batched[sql]
}

// tracedPool is a pool on the test's schema whose statements tr counts.
func tracedPool(t *testing.T) (*pgxpool.Pool, *statementTracer) {
	t.Helper()
	_, schema := pgtest.Schema(t)
	tr := &statementTracer{alone: map[string]int{}, batched: map[string]int{}}
	pool := pgtest.NewPoolWith(t, schema, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = tr })
	return pool, tr
}

func TestQueuedStatementsShareARoundTrip(t *testing.T) {
	pool, tr := tracedPool(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	const n = 200
	for i := 0; i < n; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	c, err := consumer.New(pool, b.Source(), queueEffect, fastConfig("queued"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == n }, 20*time.Second, 5*time.Millisecond)

	requireEffectsOnce(t, pool, n)
	alone, batched := tr.counts(insertEffectSQL)
	assert.Zero(t, alone, "queued statements are never sent one by one")
	assert.Equal(t, n, batched)
	assert.Zero(t, c.Stats().Retries)
}

// TestQueuedStatementsRunBeforeLaterReads: a later event of the same batch
// reads, through tx, the row an earlier event queued.
func TestQueuedStatementsRunBeforeLaterReads(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	const n = 100
	for i := 0; i < n; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.Payload.N > 0 {
			var seen int
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM effects WHERE n = $1`, ev.Payload.N-1).Scan(&seen); err != nil {
				return err
			}
			if seen != 1 {
				return fmt.Errorf("event %d does not see the effect of event %d", ev.Payload.N, ev.Payload.N-1)
			}
		}
		ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N)
		return nil
	}
	cfg := fastConfig("queued-reads")
	cfg.Retry.MaxAttempts = 1
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == n }, 20*time.Second, 5*time.Millisecond)
	assert.Len(t, countEffects(t, pool), n)
	assert.Empty(t, b.DeadLetters())
	assert.Zero(t, c.Stats().Retries)
}

// TestQueuedStatementFailureIsTheQueuingEvents: a queued statement that
// fails is charged to the event that queued it, even when it is sent
// while a later event's handler runs and that handler ignores the error
// its own statement gets; the other events of the batch commit once.
func TestQueuedStatementFailureIsTheQueuingEvents(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE effects (event_id text NOT NULL, n int NOT NULL CHECK (n >= 0), seq bigserial)`)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{Streams: 1})
	const n = 60
	for i := 0; i < n; i++ {
		v := i
		if i == 20 {
			v = -1 // violates the check when its insert runs
		}
		publish(b, fmt.Sprintf("e%d", i), v)
	}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		// A direct statement first sends what earlier events queued, and
		// fails after a queued failure; this handler swallows that error.
		_, _ = tx.Exec(ctx, `SELECT 1`)
		ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N)
		return nil
	}
	cfg := fastConfig("queued-failure")
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == n }, 20*time.Second, 5*time.Millisecond)

	got := requireEffectsOnce(t, pool, n-1)
	assert.NotContains(t, got, "e20")
	dl := b.DeadLetters()
	require.Len(t, dl, 1)
	assert.Equal(t, "e20", dl[0].Headers["id"])
	assert.Contains(t, dl[0].Headers[consumer.HeaderErrorMessage], "effects_n_check")
	assert.Equal(t, uint64(cfg.Retry.MaxAttempts-1), c.Stats().Retries, "only e20 is retried")
}

// TestQueuedCallbackError: a callback's error is the handler's; Permanent
// dead-letters at once.
func TestQueuedCallbackError(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := 0; i < 10; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		ev.Queue(`UPDATE effects SET n = n WHERE event_id = 'missing' AND $1::int >= 0`, ev.Payload.N).
			Exec(func(ct pgconn.CommandTag) error {
				if ev.Payload.N == 7 && ct.RowsAffected() == 0 {
					return consumer.Permanent(errors.New("nothing to update"))
				}
				return nil
			})
		ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N)
		return nil
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("queued-callback"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 10 }, 20*time.Second, 5*time.Millisecond)
	got := countEffects(t, pool)
	assert.Len(t, got, 9)
	assert.NotContains(t, got, "e7")
	dl := b.DeadLetters()
	require.Len(t, dl, 1)
	assert.Equal(t, "e7", dl[0].Headers["id"])
	assert.True(t, strings.Contains(dl[0].Headers[consumer.HeaderErrorMessage], "nothing to update"))
	assert.Zero(t, c.Stats().Retries, "a permanent failure is not retried")
}

func TestQueueOutsideAHandlerPanics(t *testing.T) {
	assert.PanicsWithValue(t, "consumer: Event.Queue on an event the consumer did not deliver (run the handler with consumer.Call)", func() {
		consumer.Event[order]{ID: "x"}.Queue(`SELECT 1`)
	})

	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{})
	publish(b, "e1", 1)
	kept := make(chan consumer.Event[order], 1)
	h := func(_ context.Context, _ pgx.Tx, ev consumer.Event[order]) error {
		select {
		case kept <- ev:
		default:
		}
		return nil
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("queue-late"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, 5*time.Millisecond)
	ev := <-kept
	assert.PanicsWithValue(t, "consumer: Event.Queue after the event's handler returned", func() { ev.Queue(`SELECT 1`) })
}

// TestBatchHandlerQueue: a BatchHandler may queue too; a failure fails the
// batch, whose events then run alone.
func TestBatchHandlerQueue(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	_, err := pool.Exec(context.Background(), `CREATE TABLE effects (event_id text NOT NULL, n int NOT NULL CHECK (n >= 0), seq bigserial)`)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{Streams: 1})
	for i := 0; i < 30; i++ {
		v := i
		if i == 11 {
			v = -1
		}
		publish(b, fmt.Sprintf("e%d", i), v)
	}
	h := func(_ context.Context, _ pgx.Tx, evs []consumer.Event[order]) error {
		for _, ev := range evs {
			ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N)
		}
		return nil
	}
	cfg := fastConfig("batch-queue")
	c, err := consumer.NewBatch(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 30 }, 20*time.Second, 5*time.Millisecond)
	requireEffectsOnce(t, pool, 29)
	dl := b.DeadLetters()
	require.Len(t, dl, 1)
	assert.Equal(t, "e11", dl[0].Headers["id"])
}

// TestCallRunsAHandlerLikeTheConsumer: Call sends what the handler queued
// and returns a queued statement's failure.
func TestCallRunsAHandlerLikeTheConsumer(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE effects (event_id text NOT NULL, n int NOT NULL CHECK (n >= 0), seq bigserial)`)
	require.NoError(t, err)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck

	require.NoError(t, consumer.Call(ctx, tx, queueEffect, consumer.Event[order]{ID: "a", Payload: order{N: 1}}))
	var n int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM effects WHERE event_id = 'a'`).Scan(&n))
	assert.Equal(t, 1, n, "the queued insert ran before Call returned")

	err = consumer.Call(ctx, tx, queueEffect, consumer.Event[order]{ID: "b", Payload: order{N: -1}})
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	assert.Equal(t, "23514", pgErr.Code, "check violation")

	require.ErrorIs(t, consumer.Call[order](ctx, tx, nil, consumer.Event[order]{ID: "c"}), consumer.ErrInvalidConfig)
	require.ErrorIs(t, consumer.Call(ctx, nil, queueEffect, consumer.Event[order]{ID: "c"}), consumer.ErrInvalidConfig)
}

// TestCallReturnsAHandlersPanicAsTheConsumerDoes: a handler's panic is
// returned as a *PanicError, as the consumer turns it into one (and as Call
// returns a queued callback's panic), and what the handler queued before
// it panicked is not sent.
func TestCallReturnsAHandlersPanicAsTheConsumerDoes(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE effects (event_id text NOT NULL, n int NOT NULL, seq bigserial)`)
	require.NoError(t, err)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck

	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N)
		panic("boom")
	}
	var err2 error
	require.NotPanics(t, func() { err2 = consumer.Call(ctx, tx, h, consumer.Event[order]{ID: "p", Payload: order{N: 1}}) })
	var pe *consumer.PanicError
	require.ErrorAs(t, err2, &pe)
	assert.Equal(t, "boom", pe.Value)
	assert.NotEmpty(t, pe.Stack)
	var n int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&n))
	assert.Zero(t, n, "what the handler queued before it panicked was not sent")
}

// TestCallRefusesAHandlersCommitAsTheConsumerDoes: a handler that commits
// the transaction it was given is refused and fails permanently under Call
// as under the consumer, whether or not it returns the refusal, and the
// caller's transaction is still open.
func TestCallRefusesAHandlersCommitAsTheConsumerDoes(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck

	var refused error
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		refused = tx.Commit(ctx)
		return nil
	}
	err = consumer.Call(ctx, tx, h, consumer.Event[order]{ID: "c"})
	require.ErrorIs(t, refused, consumer.ErrTxOwnedByConsumer)
	var pe *consumer.PermanentError
	require.ErrorAs(t, err, &pe, "the swallowed refusal is the handler's permanent failure")
	var one int
	require.NoError(t, tx.QueryRow(ctx, `SELECT 1`).Scan(&one), "the caller's transaction is still open")
}

// TestCallFailsAHandlerThatBrokeTheTransactionAsTheConsumerDoes: a
// handler that returns nil with the transaction unable to commit (a failed
// statement's error swallowed) or ended by a statement of its own (COMMIT,
// ROLLBACK) fails under Call as under the consumer, which retries the first
// and dead-letters the second at once.
func TestCallFailsAHandlerThatBrokeTheTransactionAsTheConsumerDoes(t *testing.T) {
	for _, tc := range []struct {
		sql       string
		permanent bool
	}{
		{`SELECT 1/0`, false},
		{`COMMIT`, true},
		{`ROLLBACK`, true},
	} {
		t.Run(tc.sql, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			ctx := context.Background()
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				_, _ = tx.Exec(ctx, tc.sql) // whatever it did, the handler goes on
				return nil
			}
			err = consumer.Call(ctx, tx, h, consumer.Event[order]{ID: "b"})
			require.Error(t, err, "the consumer would not commit this handler's transaction")
			var pe *consumer.PermanentError
			assert.Equal(t, tc.permanent, errors.As(err, &pe), "%v", err)
		})
	}
}

// TestQueuedStatementThatCannotBePreparedIsFoundByHalving: a queued
// statement the server cannot even prepare fails the whole pgx batch before
// any result names its event; the batch is halved until the event is alone,
// and no other event is charged an attempt.
func TestQueuedStatementThatCannotBePreparedIsFoundByHalving(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	const n, bad = 40, 29
	for i := 0; i < n; i++ {
		publish(b, fmt.Sprintf("e%d", i), i)
	}
	h := func(_ context.Context, _ pgx.Tx, ev consumer.Event[order]) error {
		if ev.Payload.N == bad {
			ev.Queue(`INSERT INTO no_such_table (event_id) VALUES ($1)`, ev.ID)
			return nil
		}
		ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N)
		return nil
	}
	cfg := fastConfig("unpreparable")
	cfg.Batch.Size = n
	cfg.Batch.Linger = time.Second // the whole backlog is one batch
	c, err := consumer.New(pool, b.Source(), h, cfg)
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == n }, 20*time.Second, 5*time.Millisecond)

	requireEffectsOnce(t, pool, n-1)
	dl := b.DeadLetters()
	require.Len(t, dl, 1)
	assert.Equal(t, fmt.Sprintf("e%d", bad), dl[0].Headers["id"])
	assert.Contains(t, dl[0].Headers[consumer.HeaderErrorMessage], "no_such_table")
	assert.Equal(t, uint64(cfg.Retry.MaxAttempts-1), c.Stats().Retries, "only the bad event is retried")
}

// TestQueuedCallbackPanicIsDeadLettered: a callback attached to a queued
// statement is part of its handler: its panic dead-letters the event that
// queued it (kind panic, with the stack), as a handler's panic does,
// whether the callback runs while the handler runs (a later statement
// sends the queue) or after it returned (the queue sent before COMMIT),
// instead of crashing the process on every redelivery.
func TestQueuedCallbackPanicIsDeadLettered(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		sendInHandler, query bool
	}{{"sent after the handler", false, false}, {"sent in the handler", true, false}, {"rows callback", false, true}} {
		sendInHandler, query := tc.sendInHandler, tc.query
		t.Run(tc.name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			for i := 0; i < 5; i++ {
				publish(b, fmt.Sprintf("e%d", i), i)
			}
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				if query {
					ev.Queue(`SELECT g FROM generate_series(1, 1000) g`).Query(func(rows pgx.Rows) error {
						for rows.Next() {
							if ev.ID == "e2" {
								panic("callback bug")
							}
						}
						return rows.Err()
					})
				}
				ev.Queue(insertEffectSQL, ev.ID, ev.Payload.N).Exec(func(pgconn.CommandTag) error {
					if ev.ID == "e2" && !query {
						panic("callback bug")
					}
					return nil
				})
				if sendInHandler {
					_, err := tx.Exec(ctx, `SELECT 1`)
					return err
				}
				return nil
			}
			c, err := consumer.New(pool, b.Source(), h, fastConfig("queued-callback-panic"))
			require.NoError(t, err)
			start(t, c)
			require.Eventually(t, func() bool { return b.Acked() == 5 }, 20*time.Second, 5*time.Millisecond)
			requireEffectsOnce(t, pool, 4)
			dl := b.DeadLetters()
			require.Len(t, dl, 1)
			assert.Equal(t, "e2", dl[0].Headers["id"])
			assert.Equal(t, string(consumer.KindPanic), dl[0].Headers[consumer.HeaderErrorKind])
			assert.Contains(t, dl[0].Headers[consumer.HeaderErrorMessage], "callback bug")
			assert.NotEmpty(t, dl[0].Headers[consumer.HeaderErrorStack])
		})
	}
}
