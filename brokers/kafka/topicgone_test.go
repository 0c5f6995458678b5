package kafka

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/internal/testlog"
)

// A topic deleted while its partition is consumed, then created again
// under the same name, numbers its offsets from 0 again. The member kept
// its position in the old topic and went on fetching the new one from
// there: the new topic's records below it were never handled, without a
// word (here records 100..104, at offsets 0..4, behind a position of 5).
// The claim of a topic that is gone, or whose id changed, ends without
// marking anything more, logged at Error; the group claims the topic
// again when it exists, from its start, and every record of both lives
// is handled once. With OffsetsInDatabase too, whose recorded position
// belongs to the old topic's id.
func TestTopicDeletedAndCreatedAgainWhileConsumedLosesNothing(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		for _, tc := range []struct {
			name   string
			inDB   bool
			newest bool
		}{{"offsets in Kafka", false, false}, {"offsets in the database", true, false}, {"StartNewest", false, true}} {
			t.Run(tc.name, func(t *testing.T) {
				c := newClusterOf(t, kind)
				topic, group := uniq("orders"), uniq("g")
				c.createTopic(topic, 1)
				db, _ := pgtest.Schema(t)
				_, err := db.Exec(context.Background(), effectsTable)
				require.NoError(t, err)
				errs := &testlog.ErrorLog{}
				cfg := c.config(group, topic)
				cfg.OffsetsInDatabase = tc.inDB
				if tc.newest {
					cfg.InitialOffset = StartNewest
				}
				cfg.Logger = slog.New(errs)
				src, err := Open(t.Context(), cfg)
				require.NoError(t, err)
				r := startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
				if tc.newest {
					// Records produced before the group joined are skipped.
					require.Eventually(t, func() bool { return committedOffset(c, group, topic, 0) >= 0 }, 30*time.Second, 20*time.Millisecond,
						"the group never committed its start")
				}
				c.produceHashed(idless(topic, 0, 5))
				waitEffectsByN(t, db, 5)

				c.deleteTopic(topic)
				awaitGoneLogged(t, errs, topic)
				c.createTopic(topic, 1)
				c.produceHashed(idless(topic, 100, 10))
				waitEffectsByN(t, db, 15)
				require.NoError(t, r.stop())
				want := map[int]int{}
				for _, n := range []int{0, 1, 2, 3, 4, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109} {
					want[n] = 1
				}
				require.Equal(t, want, effectsByN(t, db), "every record of both lives of the topic handled once")
			})
		}
	})
}

// awaitGoneLogged waits until errs holds the Error record of topic's
// partition 0 found deleted.
func awaitGoneLogged(t *testing.T, errs *testlog.ErrorLog, topic string) {
	t.Helper()
	gone := func() bool {
		for _, e := range errs.Errors() {
			if strings.Contains(e, "topic deleted") && strings.Contains(e, "stream="+topic+"/0") {
				return true
			}
		}
		return false
	}
	require.Eventually(t, gone, 60*time.Second, 20*time.Millisecond,
		"the deletion was not logged at Error: %q", errs.Errors())
}

// A member reading two topics, one of which is deleted, goes on with the
// other: the claim of the deleted topic's partition is held, paused, until
// the topic exists again (ending it would make the group join again, and
// the join fails for every topic while one is missing). Once the topic is
// created again its records are handled from its start.
func TestTopicDeletedWhileConsumedLeavesTheOtherTopicsGoing(t *testing.T) {
	eachBroker(t, func(t *testing.T, kind brokerKind) {
		otherTopicGoesOnWhileOneIsDeleted(t, newClusterOf(t, kind), 0)
	})
}

// otherTopicGoesOnWhileOneIsDeleted has one member read two topics of c,
// deletes one, and requires the other's records handled, one at a time,
// each within 10 s, for 3 s after the deletion was found (long past the
// end of the session, had the claim of the deleted topic ended it); then
// the deleted topic created again and every record of both handled once.
// refresh, when not 0, is the client's Metadata.RefreshFrequency.
func otherTopicGoesOnWhileOneIsDeleted(t *testing.T, c *cluster, refresh time.Duration) {
	deleted, other, group := uniq("orders"), uniq("payments"), uniq("g")
	c.createTopic(deleted, 1)
	c.createTopic(other, 1)
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	errs := &testlog.ErrorLog{}
	cfg := c.config(group, deleted, other)
	cfg.Logger = slog.New(errs)
	if refresh > 0 {
		cfg.Sarama.Metadata.RefreshFrequency = refresh
	}
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	r := startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
	c.produceHashed(idless(deleted, 0, 3))
	c.produceHashed(idless(other, 10, 3))
	waitEffectsByN(t, db, 6)

	c.deleteTopic(deleted)
	awaitGoneLogged(t, errs, deleted)
	n := 20
	for since := time.Now(); time.Since(since) < 3*time.Second; n++ {
		c.produceHashed(idless(other, n, 1))
		require.Eventually(t, func() bool { return effectsByN(t, db)[n] == 1 }, 10*time.Second, 20*time.Millisecond,
			"record %d of the topic that still exists was not handled while the other was deleted", n)
	}

	c.createTopic(deleted, 1)
	c.produceHashed(idless(deleted, 1000, 3))
	want := map[int]int{}
	for _, k := range append([]int{0, 1, 2, 10, 11, 12, 1000, 1001, 1002}, numbers(20, n)...) {
		want[k] = 1
	}
	waitEffectsByN(t, db, len(want))
	require.NoError(t, r.stop())
	require.Equal(t, want, effectsByN(t, db), "every record of both topics handled once")
}

// numbers returns from, from+1, ..., to-1.
func numbers(from, to int) []int {
	out := make([]int, 0, to-from)
	for i := from; i < to; i++ {
		out = append(out, i)
	}
	return out
}

// The same past the group leader's next check of its topics' partition
// counts (sarama's, every Metadata.RefreshFrequency, 10 min by default):
// that check finds the deleted topic missing and makes the group join
// again, and the join fails for every topic while one is missing. The
// member's other topic must still go on.
func TestTopicDeletedWhileConsumedLeavesTheOtherTopicsGoingPastAMetadataRefresh(t *testing.T) {
	// 3 s of the other topic's records: fifteen of the leader's checks.
	otherTopicGoesOnWhileOneIsDeleted(t, newCluster(t), 200*time.Millisecond)
}

// The same when the group's leader is not the member that holds the
// deleted topic's claim: the leader's check asks about every topic the
// group reads, and has no claim of the deleted topic to know it by.
func TestTopicDeletedWhileConsumedByAnotherMemberLeavesTheLeadersTopicsGoing(t *testing.T) {
	c := newCluster(t)
	deleted, other, group := uniq("orders"), uniq("payments"), uniq("g")
	c.createTopic(deleted, 1)
	c.createTopic(other, 1)
	db, _ := pgtest.Schema(t)
	_, err := db.Exec(context.Background(), effectsTable)
	require.NoError(t, err)
	open := func(logger *slog.Logger, topics ...string) *runningConsumer {
		cfg := c.config(group, topics...)
		cfg.Logger = logger
		cfg.Sarama.Metadata.RefreshFrequency = 200 * time.Millisecond
		src, err := Open(t.Context(), cfg)
		require.NoError(t, err)
		return startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
	}
	// The first member joins first and leads; it does not read deleted.
	leader := open(testLogger(), other)
	c.produceHashed(idless(other, 0, 1))
	waitEffectsByN(t, db, 1)
	errs := &testlog.ErrorLog{}
	holder := open(slog.New(errs), deleted, other)
	c.produceHashed(idless(deleted, 1, 1))
	waitEffectsByN(t, db, 2)

	c.deleteTopic(deleted)
	// For 3 s after the deletion (fifteen of the leader's checks), each
	// record of the other topic is handled within 10 s.
	n := 20
	for since := time.Now(); time.Since(since) < 3*time.Second; n++ {
		c.produceHashed(idless(other, n, 1))
		require.Eventually(t, func() bool { return effectsByN(t, db)[n] == 1 }, 10*time.Second, 20*time.Millisecond,
			"record %d of the topic that still exists was not handled while the other was deleted", n)
	}
	awaitGoneLogged(t, errs, deleted)
	require.NoError(t, holder.stop())
	require.NoError(t, leader.stop())
}
