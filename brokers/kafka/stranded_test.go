package kafka

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
)

// With OffsetsInDatabase, a member takes its partitions over in the
// offsets table when the group rebalances. On a pooled connection whose
// server vanished without a word (a failover's old primary, a middlebox
// that forgot it) that statement, or the ping pgxpool sends before it,
// went unanswered until the operating system gave up on the connection (a
// quarter of an hour by Linux's defaults; for ever here), and the
// member's partitions stood still though the group had given them to it.
// Each attempt is bounded by the consumer's DatabaseTimeout, then retried
// on another connection.
func TestTakeOverOnAStrandedConnectionIsLeftBehind(t *testing.T) {
	c := newCluster(t)
	topic := uniq("orders")
	c.createTopic(topic, 2)
	admin, schema := pgtest.Schema(t)
	_, err := admin.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	poolA, proxy := pgtest.NewPoolThroughProxy(t, schema, func(cfg *pgxpool.Config) {
		// pgxpool pings a connection idle for more than a second before
		// handing it out; here every time, as after a quiet spell.
		cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return true }
	})

	group := uniq("g")
	acfg := consumerConfig("svc")
	acfg.DatabaseTimeout = 300 * time.Millisecond
	srcA, err := Open(t.Context(), c.dbOffsetsConfig(group, topic))
	require.NoError(t, err)
	startConsumer(t, poolA, srcA, acfg, recordEffect)
	c.produceHashed(mixedEvents(topic, 0, 8))
	waitEffectsByN(t, admin, 8)

	before := maxGeneration(t, admin)
	require.Positive(t, proxy.Strand(), "A's connections stranded")
	// B joins: the group rebalances, and A takes its share over in the
	// offsets table on its pool's connections.
	srcB, err := Open(t.Context(), c.dbOffsetsConfig(group, topic))
	require.NoError(t, err)
	startConsumer(t, admin, srcB, consumerConfig("svc"), recordEffect)
	require.Eventually(t, func() bool { return maxGeneration(t, admin) > before }, 30*time.Second, 10*time.Millisecond,
		"a member took a partition over in a new generation: the group rebalanced")
	c.produceHashed(mixedEvents(topic, 8, 24))
	waitEffectsByN(t, admin, 32)
	requireEachOnce(t, admin, 32)
}

// maxGeneration is the newest group generation that took a partition over
// in the offsets table.
func maxGeneration(t testing.TB, db *pgxpool.Pool) int {
	t.Helper()
	var g int
	require.NoError(t, db.QueryRow(context.Background(), `SELECT coalesce(max(generation), -1) FROM processed_events_offsets WHERE consumer = 'svc'`).Scan(&g))
	return g
}
