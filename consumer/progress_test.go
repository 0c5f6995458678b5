package consumer_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
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
	"github.com/onceco/once/dedup"
	"github.com/onceco/once/internal/pgtest"
)

// progressSource is a memsource Source that records the offsets of the
// deliveries each transaction settles in a progress table, in that
// transaction, and deduplicates its deliveries by position. failures are
// returned by the first calls of RecordProgress, in turn.
type progressSource struct {
	*memsource.Source
	bound    consumer.ProgressBinding
	mu       sync.Mutex
	failures []error
}

func (s *progressSource) BindProgress(_ context.Context, b consumer.ProgressBinding) error {
	s.bound = b
	return nil
}

func (s *progressSource) RecordProgress(ctx context.Context, tx pgx.Tx, ds []consumer.Delivery) error {
	s.mu.Lock()
	if len(s.failures) > 0 {
		err := s.failures[0]
		s.failures = s.failures[1:]
		s.mu.Unlock()
		return err
	}
	s.mu.Unlock()
	for _, d := range ds {
		if _, err := tx.Exec(ctx, `INSERT INTO progress (off) VALUES ($1)`, d.Message().Offset); err != nil {
			return err
		}
	}
	return nil
}

func (s *progressSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return positional{d}, nil
}

// positional is a delivery deduplicated by its position.
type positional struct{ consumer.Delivery }

func (positional) DeduplicatedByPosition() bool { return true }

// progressed returns the offsets recorded in the progress table.
func progressed(t *testing.T, ctx context.Context, db interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}) []int64 {
	t.Helper()
	rows, err := db.Query(ctx, `SELECT off FROM progress ORDER BY off`)
	require.NoError(t, err)
	offs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	return offs
}

// A ProgressRecorder source is bound at Run and writes in the transaction
// of the messages it settles: handled ones and duplicates, not dead
// letters. Messages without an id of their own (their id is the
// FallbackID) get no processed-events row; messages with one do.
func TestProgressRecordedInTheTransaction(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE progress (off bigint NOT NULL)`)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{Streams: 1, FallbackID: true})
	b.Publish(consumer.Message{Value: []byte(`{"n":0}`)})
	b.Publish(consumer.Message{ID: "with-id", Value: []byte(`{"n":1}`)})
	b.Publish(consumer.Message{Value: []byte(`{"n":2}`)}) // fails for good
	b.Publish(consumer.Message{ID: "with-id", Value: []byte(`{"n":1}`)})
	b.Publish(consumer.Message{Value: []byte(`{"n":4}`)})
	src := &progressSource{Source: b.Source()}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.Payload.N == 2 {
			return consumer.Permanent(errors.New("refused"))
		}
		return insertEffect(ctx, tx, ev)
	}
	c, err := consumer.New(pool, src, h, fastConfig("progress"))
	require.NoError(t, err)
	stop := start(t, c)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(wctx, 5))
	require.NoError(t, stop())

	assert.Equal(t, "progress", src.bound.Consumer)
	assert.NotNil(t, src.bound.Pool)
	assert.NotNil(t, src.bound.Store)
	assert.Equal(t, []int64{0, 1, 3, 4}, progressed(t, ctx, pool), "the handled and the duplicate, not the dead letter")
	assert.Len(t, b.DeadLetters(), 1)
	var ids []string
	rows, err := pool.Query(ctx, `SELECT event_id FROM processed_events ORDER BY event_id`)
	require.NoError(t, err)
	ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	assert.Equal(t, []string{"with-id"}, ids, "records identified by position only have no row")
	assert.Equal(t, map[string]int{"mem/0": 1, "with-id": 1, "mem/4": 1}, countEffects(t, pool))
}

// A fenced progress write (dedup.ErrFenced) rolls the transaction back and
// abandons its message: not acked, not dead-lettered, not retried. Any
// other error of the source is an infrastructure failure, retried.
func TestProgressFencedAbandonsOtherErrorsRetry(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE progress (off bigint NOT NULL)`)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{FallbackID: true})
	b.Publish(consumer.Message{Value: []byte(`{"n":0}`)})
	src := &progressSource{Source: b.Source(), failures: []error{errors.New("lost connection"), fmt.Errorf("taken: %w", dedup.ErrFenced)}}
	var abandoned atomic.Int32
	cfg := fastConfig("fenced")
	cfg.Batch.Size = 1
	cfg.Hooks.OnOutcome = func(_ context.Context, o consumer.Outcome) {
		if o.Result == consumer.ResultAbandoned {
			abandoned.Add(1)
		}
	}
	c, err := consumer.New(pool, src, insertEffect, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	require.Eventually(t, func() bool { return abandoned.Load() == 1 }, 30*time.Second, 5*time.Millisecond)
	st := c.Stats()
	assert.Equal(t, uint64(1), st.InfraErrors, "the first failure was retried as infrastructure")
	assert.Zero(t, st.Handled)
	assert.Zero(t, st.DeadLettered)
	assert.False(t, b.IsAcked(0), "the fenced message is not acked")
	assert.Empty(t, countEffects(t, pool), "its effect rolled back")
	assert.Empty(t, progressed(t, ctx, pool))

	// The consumer goes on: the next message is handled as usual.
	b.Publish(consumer.Message{Value: []byte(`{"n":1}`)})
	require.Eventually(t, func() bool { return b.IsAcked(1) }, 30*time.Second, 5*time.Millisecond)
	require.NoError(t, stop())
	assert.Equal(t, []int64{1}, progressed(t, ctx, pool))
}

// replyLostConn is a connection to PostgreSQL that loses the reply to the
// first COMMIT it sends once armed: the server commits, the client sees
// the connection die, the outcome unknown.
type replyLostConn struct {
	net.Conn
	armed *atomic.Bool
	// lost counts the replies lost.
	lost *atomic.Int32
	lose bool
}

func (c *replyLostConn) Write(b []byte) (int, error) {
	if bytes.Contains(b, []byte("commit\x00")) && c.armed.CompareAndSwap(true, false) {
		c.lose = true
	}
	return c.Conn.Write(b)
}

func (c *replyLostConn) Read(b []byte) (int, error) {
	if c.lose {
		// The server answers once the commit is durable; the answer is
		// lost with the connection.
		_, _ = c.Conn.Read(b)
		_ = c.Close()
		c.lose = false
		c.lost.Add(1)
		return 0, io.ErrUnexpectedEOF
	}
	return c.Conn.Read(b)
}

// A COMMIT whose reply is lost (the connection died after the server
// committed) is retried, and for a message with an id of its own the
// retry's claim finds the row: a duplicate. A message deduplicated by its
// position has no row for the retry to find: it must not be handled
// again, which would commit its effect twice.
func TestCommitOfUnknownOutcomeForAPositionDeduplicatedMessage(t *testing.T) {
	_, schema := pgtest.Schema(t)
	var armed atomic.Bool
	var lost atomic.Int32
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) {
		dial := c.ConnConfig.DialFunc
		c.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := dial(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &replyLostConn{Conn: conn, armed: &armed, lost: &lost}, nil
		}
	})
	effects(t, pool)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE progress (off bigint NOT NULL)`)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{Streams: 1, FallbackID: true})
	b.Publish(consumer.Message{Value: []byte(`{"n":0}`)})
	src := &progressSource{Source: b.Source()}
	var runs atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if runs.Add(1) == 1 {
			armed.Store(true) // lose the first transaction's COMMIT reply
		}
		return insertEffect(ctx, tx, ev)
	}
	cfg := fastConfig("unknown-commit")
	c, err := consumer.New(pool, src, h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(wctx, 1))
	require.NoError(t, stop())
	require.Equal(t, int32(1), lost.Load(), "the first COMMIT's reply was lost")
	assert.Equal(t, map[string]int{"mem/0": 1}, countEffects(t, pool))
	assert.Equal(t, int32(1), runs.Load(), "the handler ran once")
	assert.Equal(t, []int64{0}, progressed(t, ctx, pool))
}

// With a ProgressRecorder source, a handler that swallowed a failed
// statement's error (the transaction aborted), or that committed the
// consumer's transaction itself, fails like it does without one: the
// message meets the retry policy and is dead-lettered, instead of the
// source's write in the dead transaction being retried as an
// infrastructure failure without end, holding the stream.
func TestProgressAfterAHandlerBrokeItsTransaction(t *testing.T) {
	for _, tc := range []struct {
		name    string
		breakTx func(context.Context, pgx.Tx) error
		runs    int
	}{
		{"swallowed error", func(ctx context.Context, tx pgx.Tx) error {
			_, _ = tx.Exec(ctx, `SELECT 1/0`) // the error is dropped
			return nil
		}, 3},
		{"committed by the handler", func(ctx context.Context, tx pgx.Tx) error {
			return tx.Commit(ctx)
		}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			ctx := context.Background()
			_, err := pool.Exec(ctx, `CREATE TABLE progress (off bigint NOT NULL)`)
			require.NoError(t, err)
			b := memsource.New(memsource.Options{Streams: 1, FallbackID: true})
			b.Publish(consumer.Message{Value: []byte(`{"n":0}`)})
			b.Publish(consumer.Message{Value: []byte(`{"n":1}`)})
			src := &progressSource{Source: b.Source()}
			var runs atomic.Int32
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				if ev.Payload.N == 0 {
					runs.Add(1)
					return tc.breakTx(ctx, tx)
				}
				return insertEffect(ctx, tx, ev)
			}
			cfg := fastConfig("broken-tx")
			cfg.Batch.Size = 1 // a handler's commit would take its neighbours' claims along
			c, err := consumer.New(pool, src, h, cfg)
			require.NoError(t, err)
			stop := start(t, c)
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			require.NoError(t, b.WaitAcked(wctx, 2), "the stream goes on (infrastructure failures: %d)", c.Stats().InfraErrors)
			require.NoError(t, stop())
			require.Len(t, b.DeadLetters(), 1)
			assert.Equal(t, int32(tc.runs), runs.Load())
			assert.Zero(t, c.Stats().InfraErrors)
			assert.Equal(t, []int64{1}, progressed(t, ctx, pool))
		})
	}
}

// A handler that commits the consumer's transaction gives its connection
// back to the pool, where another may take it and begin a transaction of
// its own: the handler's commit is still its failure, known from the Tx it
// went through and not from that connection, whose state is now the
// other's. (Read from the connection, it passed for a live transaction:
// the source's progress then failed on the closed one and was retried as
// an infrastructure failure without end.)
func TestHandlersCommitIsKnownWhenItsConnectionWentToAnother(t *testing.T) {
	_, schema := pgtest.Schema(t)
	pool := pgtest.NewPoolWith(t, schema, func(c *pgxpool.Config) { c.MaxConns = 1 })
	effects(t, pool)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE progress (off bigint NOT NULL)`)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{Streams: 1, FallbackID: true})
	b.Publish(consumer.Message{Value: []byte(`{"n":0}`)})
	b.Publish(consumer.Message{Value: []byte(`{"n":1}`)}) // its handler commits
	src := &progressSource{Source: b.Source()}
	var mu sync.Mutex
	var other pgx.Tx // the transaction that took the handler's connection
	release := func() {
		mu.Lock()
		defer mu.Unlock()
		if other != nil {
			_ = other.Rollback(ctx)
			other = nil
		}
	}
	t.Cleanup(release)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if ev.Payload.N == 0 {
			return insertEffect(ctx, tx, ev)
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		o, err := pool.Begin(ctx) // the only connection, given back by the commit
		if err != nil {
			return err
		}
		mu.Lock()
		other = o
		mu.Unlock()
		return nil
	}
	cfg := fastConfig("committed-elsewhere")
	cfg.Concurrency = 1
	cfg.Batch.Size = 1
	cfg.Hooks.OnOutcome = func(_ context.Context, o consumer.Outcome) {
		if o.Result == consumer.ResultDeadLettered {
			release()
		}
	}
	c, err := consumer.New(pool, src, h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(wctx, 2), "infrastructure failures: %d", c.Stats().InfraErrors)
	require.NoError(t, stop())
	require.Len(t, b.DeadLetters(), 1)
	assert.Zero(t, c.Stats().InfraErrors)
}

// With a source that deduplicates its messages by position, a handler that
// ends its batch's transaction with a COMMIT of its own is dead-lettered,
// and each other message of the batch has its effect once: those before
// it, whose effects that COMMIT made durable without their progress, are
// recorded done instead of running again.
func TestHandlerEndingTheBatchTransactionOfPositionDeduplicatedMessages(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE progress (off bigint NOT NULL)`)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{Streams: 1, FallbackID: true})
	for i := range 6 {
		b.Publish(consumer.Message{Value: []byte(fmt.Sprintf(`{"n":%d}`, i))})
	}
	src := &progressSource{Source: b.Source()}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		if err := insertEffect(ctx, tx, ev); err != nil {
			return err
		}
		if ev.Payload.N == 2 {
			_, err := tx.Exec(ctx, "COMMIT")
			return err
		}
		return nil
	}
	cfg := fastConfig("ends-tx-positions")
	cfg.Batch.Linger = time.Second // one batch of all six
	c, err := consumer.New(pool, src, h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(wctx, 6))
	require.NoError(t, stop())
	got := countEffects(t, pool)
	delete(got, "mem/2") // its own COMMIT made its writes durable
	assert.Equal(t, map[string]int{"mem/0": 1, "mem/1": 1, "mem/3": 1, "mem/4": 1, "mem/5": 1}, got,
		"every other message of the batch has its effect once")
	assert.Equal(t, map[string]string{"mem/2": string(consumer.KindHandler)}, deadLetterKinds(b))
	assert.Equal(t, []int64{0, 1, 3, 4, 5}, progressed(t, ctx, pool))
}

// The same with a BatchHandler: its own COMMIT made the effects of the
// events it had written so far durable without their progress, and what it
// wrote after that COMMIT went through at once. Position-deduplicated
// events have no claim row for a later run to find, so running the batch
// again (halving it to find the failing event) wrote every effect again.
// None is handled again: each event has its effect once, and its progress
// is recorded.
func TestBatchHandlerEndingItsTransactionOfPositionDeduplicatedMessages(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE progress (off bigint NOT NULL)`)
	require.NoError(t, err)
	b := memsource.New(memsource.Options{Streams: 1, FallbackID: true})
	for i := range 6 {
		b.Publish(consumer.Message{Value: []byte(fmt.Sprintf(`{"n":%d}`, i))})
	}
	src := &progressSource{Source: b.Source()}
	h := func(ctx context.Context, tx pgx.Tx, evs []consumer.Event[order]) error {
		for _, ev := range evs {
			if err := insertEffect(ctx, tx, ev); err != nil {
				return err
			}
			if ev.Payload.N == 2 {
				if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
					return err
				}
			}
		}
		return nil
	}
	cfg := fastConfig("batch-ends-tx-positions")
	cfg.Batch.Linger = time.Second // one batch of all six
	c, err := consumer.NewBatch(pool, src, h, cfg)
	require.NoError(t, err)
	stop := start(t, c)
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(wctx, 6))
	require.NoError(t, stop())
	assert.Equal(t, map[string]int{"mem/0": 1, "mem/1": 1, "mem/2": 1, "mem/3": 1, "mem/4": 1, "mem/5": 1}, countEffects(t, pool),
		"every event of the batch has its effect once")
	assert.Empty(t, b.DeadLetters())
	assert.Equal(t, []int64{0, 1, 2, 3, 4, 5}, progressed(t, ctx, pool))
}
