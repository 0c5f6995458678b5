package consumer_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// While an Identify.EventID that asked for a retry is retried, the message
// has no id yet: OnRetry's EventID, documented as empty only for a batch's
// failure, and the Debug log's event_id were empty, and nothing else said
// which message waited (Messages 1), so a user could not tell one stuck
// message from another. OnRetry gets the Message (its topic, partition
// and offset), and the log its place in its stream.
func TestEventIDRetryNamesTheMessageThatWaits(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	publishRaw(b, "before", mustJSON(t, order{N: 1}))
	publishRaw(b, "late", mustJSON(t, order{N: 2}))
	lookup := &flakyLookup{down: map[string]bool{"late": true}, failures: 1, wrap: retryLater}
	var retries retryLog
	logs := &levelLog{}
	cfg := fastConfig("eventid-retry-place")
	cfg.Identify.EventID = lookup.eventID
	cfg.Hooks.OnRetry = retries.hook
	cfg.Telemetry.Logger = slog.New(logs)
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, 2))

	waits := retries.of(consumer.RetryDecode)
	require.Len(t, waits, 1, "one failed lookup, then identified")
	assert.Empty(t, waits[0].EventID, "no id yet")
	require.NotNil(t, waits[0].Message, "the message that waits")
	assert.Equal(t, "late", waits[0].Message.Headers["id"])
	assert.EqualValues(t, 1, waits[0].Message.Offset)
	var logged []string
	for _, l := range logs.lines() {
		if strings.Contains(l, "asked for a retry") {
			logged = append(logged, l)
		}
	}
	require.Len(t, logged, 1)
	assert.Contains(t, logged[0], "stream=mem/0")
	assert.Contains(t, logged[0], "offset=1")
}
