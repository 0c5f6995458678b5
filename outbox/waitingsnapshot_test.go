package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// A Requeue or Discard run in a REPEATABLE READ transaction (the parked
// rows listed and requeued in one consistent snapshot) whose snapshot was
// taken before the relay marked the rows behind the parked one waiting:
// the release trigger's UPDATE reads that snapshot, in which those rows
// are not waiting (or do not exist yet), and gave none of them back. They
// stayed out of the relay's reads for ever, the key stuck though nothing
// held it any more. The relay now gives back, with its marking reads, the
// waiting rows that no refused row of their key is ahead of.
func TestRowsMarkedWaitingAfterARequeuesSnapshotAreGivenBack(t *testing.T) {
	const waiting = 20
	store, err := outbox.New(outbox.Config{})
	require.NoError(t, err)
	ctx := context.Background()
	for name, tc := range map[string]struct {
		// release ends the parked row's refusal in tx and returns the
		// bodies of key "a" expected on its topic.
		release func(t *testing.T, tx pgx.Tx, seq int64) []string
	}{
		"requeued": {func(t *testing.T, tx pgx.Tx, seq int64) []string {
			n, err := store.Requeue(ctx, tx, seq)
			require.NoError(t, err)
			require.EqualValues(t, 1, n)
			return bodiesFrom(1, waiting+1)
		}},
		"discarded": {func(t *testing.T, tx pgx.Tx, seq int64) []string {
			n, err := store.Discard(ctx, tx, seq)
			require.NoError(t, err)
			require.EqualValues(t, 1, n)
			return bodiesFrom(2, waiting+1)
		}},
	} {
		t.Run(name, func(t *testing.T) {
			k := newKafka(t)
			pool, _ := migrated(t)
			d := k.destination(t)
			startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 1})
			first := d.unroutable("a", "a/1")
			addCommitted(t, pool, first)
			waitRows(t, pool, "parked_at IS NOT NULL", 1, 30*time.Second)

			// The operator's transaction takes its snapshot: it lists
			// the parked row.
			tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(ctx) }() // after its commit, a no-op
			parked, err := store.Parked(ctx, tx, 0)
			require.NoError(t, err)
			require.Len(t, parked, 1)

			// Meanwhile rows of its key are written, and the relay marks
			// them waiting.
			var behind []outbox.Message
			for i := 2; i <= waiting+1; i++ {
				behind = append(behind, outbox.Message{Topic: first.Topic, Key: []byte("a"), Body: []byte(fmt.Sprintf("a/%d", i))})
			}
			addCommitted(t, pool, behind...)
			waitRows(t, pool, "waiting", waiting, 30*time.Second)

			createTopic(t, k, first.Topic)
			want := tc.release(t, tx, parked[0].Seq)
			require.NoError(t, tx.Commit(ctx))

			created := &kafkaDest{k: k, topic: first.Topic}
			assert.Equal(t, want, bodiesOfKey(created.read(t, len(want)), "a"), "the key's rows, in order")
			waitRows(t, pool, "true", 0, 30*time.Second)
		})
	}
}
