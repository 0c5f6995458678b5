package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// Rows waiting behind a refused row of their key were passed over by
// every read of the outbox for as long as the refused row lasted (about
// 1 µs each: a key parked for an hour under a steady stream of its rows
// slowed every other key's publishing without bound, and past about ten
// million rows a read outlasted the relay's bound on its statements). A
// read now marks the rows it passes over waiting, which takes them out of
// the index it reads; a refused row that stops holding its key back gives
// them back, in order, however it goes: discarded, requeued, requeued by
// the SQL an older release runs, or retried and sent.
func TestRowsWaitingBehindARefusedRowLeaveTheRelaysReads(t *testing.T) {
	const waiting = 200
	store, err := outbox.New(outbox.Config{})
	require.NoError(t, err)
	ctx := context.Background()
	for name, tc := range map[string]struct {
		maxAttempts int
		// release ends the refusal of the row of seq, whose topic now
		// exists, and returns the bodies of key "a" expected on it.
		release func(t *testing.T, pool *pgxpool.Pool, seq int64) []string
	}{
		"discarded": {1, func(t *testing.T, pool *pgxpool.Pool, seq int64) []string {
			n, err := store.Discard(ctx, pool, seq)
			require.NoError(t, err)
			require.EqualValues(t, 1, n)
			return bodiesFrom(2, waiting+1)
		}},
		"requeued": {1, func(t *testing.T, pool *pgxpool.Pool, seq int64) []string {
			n, err := store.Requeue(ctx, pool, seq)
			require.NoError(t, err)
			require.EqualValues(t, 1, n)
			return bodiesFrom(1, waiting+1)
		}},
		"requeued by an older release's SQL": {1, func(t *testing.T, pool *pgxpool.Pool, seq int64) []string {
			_, err := pool.Exec(ctx, `UPDATE outbox SET parked_at = NULL, attempts = 0, not_before = NULL
WHERE seq = ANY($1::bigint[]) AND parked_at IS NOT NULL AND sent_at IS NULL`, []int64{seq})
			require.NoError(t, err)
			return bodiesFrom(1, waiting+1)
		}},
		"retried and sent": {1000, func(t *testing.T, pool *pgxpool.Pool, seq int64) []string {
			return bodiesFrom(1, waiting+1) // the topic exists: the next retry is sent
		}},
	} {
		t.Run(name, func(t *testing.T) {
			k := newKafka(t)
			pool, _ := migrated(t)
			d := k.destination(t)
			startRelay(t, pool, k.publisher(t), outbox.RelayConfig{
				PollInterval: 20 * time.Millisecond, MaxAttempts: tc.maxAttempts,
				RetryBackoff: outbox.Backoff{Initial: 50 * time.Millisecond, Max: 100 * time.Millisecond},
			})
			first := d.unroutable("a", "a/1")
			addCommitted(t, pool, first)
			waitRows(t, pool, "attempts > 0", 1, 30*time.Second)
			var seq int64
			require.NoError(t, pool.QueryRow(ctx, `SELECT seq FROM outbox WHERE attempts > 0`).Scan(&seq))

			var behind []outbox.Message
			for i := 2; i <= waiting+1; i++ {
				behind = append(behind, outbox.Message{Topic: first.Topic, Key: []byte("a"), Body: []byte(fmt.Sprintf("a/%d", i))})
			}
			addCommitted(t, pool, append(behind, d.msg("b", "b/1"), d.msg("c", "c/1"))...)
			assert.ElementsMatch(t, []string{"b/1", "c/1"}, bodies(d.read(t, 2)))
			waitRows(t, pool, "waiting", waiting, 30*time.Second)
			assert.Zero(t, rows(t, pool, "sent_at IS NULL AND parked_at IS NULL AND NOT waiting AND attempts = 0"),
				"no row the relay's reads walk: each waiting row is out of its index")

			created := &kafkaDest{k: k, topic: first.Topic}
			createTopic(t, k, first.Topic)
			want := tc.release(t, pool, seq)
			assert.Equal(t, want, bodiesOfKey(created.read(t, len(want)), "a"), "the key's rows, in order")
			waitRows(t, pool, "true", 0, 30*time.Second)
		})
	}
}

// bodiesFrom returns "a/from" to "a/to".
func bodiesFrom(from, to int) []string {
	var out []string
	for i := from; i <= to; i++ {
		out = append(out, fmt.Sprintf("a/%d", i))
	}
	return out
}
