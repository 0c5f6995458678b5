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
		for _, inDB := range []bool{false, true} {
			name := "offsets in Kafka"
			if inDB {
				name = "offsets in the database"
			}
			t.Run(name, func(t *testing.T) {
				c := newClusterOf(t, kind)
				topic, group := uniq("orders"), uniq("g")
				c.createTopic(topic, 1)
				db, _ := pgtest.Schema(t)
				_, err := db.Exec(context.Background(), effectsTable)
				require.NoError(t, err)
				errs := &testlog.ErrorLog{}
				cfg := c.config(group, topic)
				cfg.OffsetsInDatabase = inDB
				cfg.Logger = slog.New(errs)
				src, err := Open(t.Context(), cfg)
				require.NoError(t, err)
				r := startConsumer(t, db, src, consumerConfig("svc"), recordEffect)
				c.produceHashed(idless(topic, 0, 5))
				waitEffectsByN(t, db, 5)

				c.deleteTopic(topic)
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
