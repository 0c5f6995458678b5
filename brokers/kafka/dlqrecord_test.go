package kafka

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/dedup"
)

// With OffsetsInDatabase, a dead-lettered record's Ack marks its offset
// and then records it done in the offsets table; when that write failed,
// the consumer logged that the message "will be redelivered, and may be
// dead-lettered again". It was not: the claim went on past it, and the
// partition's next transaction recorded everything below its record done,
// the dead letter's too. It is handed out again only when the partition
// changes owner (a restart, a rebalance) before another of its records is
// recorded done. The warning says so.
func TestOffsetsInDatabaseFailedRecordOfADeadLetterSaysWhatHappens(t *testing.T) {
	c := newCluster(t)
	topic, group := uniq("orders"), uniq("g")
	c.createTopic(topic, 1)
	db := effectsDB(t)
	store, err := dedup.New(dedup.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background(), db))
	// The first write that records offset 0 done fails.
	_, err = db.Exec(context.Background(), `CREATE SEQUENCE dead_letter_records;
CREATE FUNCTION fail_first_record() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF NEW.next_offset >= 1 AND (TG_OP = 'INSERT' OR OLD.next_offset < 1) AND nextval('dead_letter_records') = 1 THEN
		RAISE EXCEPTION 'canceling statement due to statement timeout' USING ERRCODE = '57014';
	END IF;
	RETURN NEW;
END $$;
CREATE TRIGGER fail_first_record BEFORE INSERT OR UPDATE ON processed_events_offsets FOR EACH ROW EXECUTE FUNCTION fail_first_record()`)
	require.NoError(t, err)
	poisonFirst := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[event]) error {
		if ev.Payload.N == 0 {
			return consumer.Permanent(errors.New("poison"))
		}
		return recordEffect(ctx, tx, ev)
	}
	var mu sync.Mutex
	var text strings.Builder
	ccfg := consumerConfig("svc")
	ccfg.Telemetry.Logger = slog.New(slog.NewTextHandler(lockedWriter{&mu, &text}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	logged := func() string {
		mu.Lock()
		defer mu.Unlock()
		return text.String()
	}
	cfg := c.dbOffsetsConfig(group, topic)

	c.produce(idless(topic, 0, 1)...) // the poison record, offset 0
	src, err := Open(t.Context(), cfg)
	require.NoError(t, err)
	r := startConsumer(t, db, src, ccfg, poisonFirst)
	require.Eventually(t, func() bool { return strings.Contains(logged(), "ack of a dead-lettered message failed") }, 30*time.Second, 10*time.Millisecond,
		"the record of the dead letter fails")
	c.produce(idless(topic, 1, 1)...)
	waitEffectsByN(t, db, 1)
	require.NoError(t, r.stop())
	assert.Equal(t, map[int32]int64{0: 2}, offsetsRows(t, db, topic), "the next transaction recorded the dead letter's offset done")

	// Restarted, the consumer does not see the poison record again.
	c.produce(idless(topic, 2, 1)...)
	src, err = Open(t.Context(), cfg)
	require.NoError(t, err)
	r = startConsumer(t, db, src, ccfg, poisonFirst)
	waitEffectsByN(t, db, 2)
	require.NoError(t, r.stop())
	assert.Len(t, c.readAll(cfg.withDefaults().DeadLetter.Topic(topic)), 1, "one dead-letter copy")

	var line string
	for _, l := range strings.Split(logged(), "\n") {
		if strings.Contains(l, "ack of a dead-lettered message failed") {
			line = l
		}
	}
	assert.NotContains(t, line, "will be redelivered", "the claim went on past it")
	assert.Contains(t, line, "before another of its records is recorded done", "the warning says when it is redelivered")
}
