package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// errLookupDown is what an EventID that looks the id up in another
// service meets while that service is down: a failure of the moment.
var errLookupDown = errors.New("id service unavailable")

// flakyLookup is an Identify.EventID that looks each message's id up in a
// service, which is down for the messages (by their "id" header) in down,
// for their first failures lookups each (-1: for ever). It fails with
// wrap(errLookupDown) and counts its calls per message.
type flakyLookup struct {
	down     map[string]bool
	failures int
	wrap     func(error) error
	mu       sync.Mutex
	calls    map[string]int
}

func (l *flakyLookup) eventID(m *consumer.Message) (string, error) {
	key := m.Headers["id"]
	l.mu.Lock()
	if l.calls == nil {
		l.calls = map[string]int{}
	}
	l.calls[key]++
	n := l.calls[key]
	l.mu.Unlock()
	if l.down[key] && (l.failures < 0 || n <= l.failures) {
		return "", l.wrap(errLookupDown)
	}
	return "looked-up-" + key, nil
}

func (l *flakyLookup) callsOf(key string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.calls[key]
}

// retryLater is the wrap of an EventID that asks for a later try.
func retryLater(err error) error { return consumer.RetryAfter(time.Millisecond, err) }

// An Identify.EventID that looks the id up in a service that is down for
// a moment says so with RetryAfter, as a Decoder would: the message is
// identified again after the delay, in its place in the stream, and
// handled under its id once the service answers. It was dead-lettered at
// once as missing-id: every message of the service's outage ended in the
// dead-letter queue, against the function's own word that it would pass.
func TestEventIDRetryAfterIsRetriedInItsPlace(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	for i, id := range []string{"before", "late", "after"} {
		publishRaw(b, id, mustJSON(t, order{N: i + 1}))
	}
	lookup := &flakyLookup{down: map[string]bool{"late": true}, failures: 2, wrap: retryLater}
	var commits commitLog
	var retries retryLog
	cfg := fastConfig("eventid-retry-after")
	cfg.Identify.EventID = lookup.eventID
	cfg.Batch = consumer.BatchConfig{Size: 3, Linger: 5 * time.Second}
	cfg.Hooks.AfterCommit = commits.hook
	cfg.Hooks.OnRetry = retries.hook
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, b.WaitAcked(ctx, 3))

	assert.Empty(t, b.DeadLetters(), "the id lookup asked for a later try")
	assert.Equal(t, 3, lookup.callsOf("late"), "two failures, then identified")
	assert.Equal(t, []string{"looked-up-before", "looked-up-late", "looked-up-after"}, slices.Concat(commits.transactions()...),
		"each message committed once, under its looked-up id, in stream order")
	requireEffectsOnce(t, pool, 3)
	waits := retries.of(consumer.RetryDecode)
	require.Len(t, waits, 2)
	for _, w := range waits {
		assert.Equal(t, time.Millisecond, w.Wait, "the delay the lookup asked for")
		assert.ErrorIs(t, w.Err, errLookupDown)
	}
	assert.Equal(t, uint64(3), c.Stats().Handled)
}

// Retrying an id lookup is bounded by Retry.MaxAttempts: a service that
// stays down ends in the dead-letter queue with kind missing-id (the kind
// an EventID's error is documented to give) after MaxAttempts lookups, and
// the stream goes on. A plain error, or a RetryAfter inside Permanent, is
// still dead-lettered at once.
func TestEventIDRetryAfterIsDeadLetteredAfterMaxAttempts(t *testing.T) {
	for _, tc := range []struct {
		name  string
		wrap  func(error) error
		calls int // lookups of the message that fails, -1: MaxAttempts
	}{
		{"retry-after", retryLater, -1},
		{"plain", func(err error) error { return err }, 1},
		{"permanent", func(err error) error { return consumer.Permanent(retryLater(err)) }, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool, _ := pgtest.Schema(t)
			effects(t, pool)
			b := memsource.New(memsource.Options{Streams: 1})
			publishRaw(b, "down", mustJSON(t, order{N: 1}))
			publishRaw(b, "next", mustJSON(t, order{N: 2}))
			lookup := &flakyLookup{down: map[string]bool{"down": true}, failures: -1, wrap: tc.wrap}
			cfg := fastConfig("eventid-retry-after-spent")
			cfg.Identify.EventID = lookup.eventID
			c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
			require.NoError(t, err)
			start(t, c)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			require.NoError(t, b.WaitAcked(ctx, 2))

			want := tc.calls
			if want < 0 {
				want = cfg.Retry.MaxAttempts
			}
			assert.Equal(t, want, lookup.callsOf("down"), "lookups of the failing message")
			dls := b.DeadLetters()
			require.Len(t, dls, 1)
			assert.Equal(t, "down", dls[0].Headers["id"])
			assert.Equal(t, string(consumer.KindMissingID), dls[0].Headers[consumer.HeaderErrorKind])
			// No id: EventID gave none. The id header is not the event's
			// id under EventID, which replaces that rule; a redrive
			// claimed under it (HeaderRedriveEventID) would be another
			// event than the one EventID names once its service is back.
			assert.Empty(t, dls[0].Headers[consumer.HeaderEventID], "a missing-id dead letter has no id")
			assert.Equal(t, "0", dls[0].Headers[consumer.HeaderAttempts], "the handler never ran")
			assert.Contains(t, dls[0].Headers[consumer.HeaderErrorMessage], errLookupDown.Error())
			assert.Equal(t, map[string]int{"looked-up-next": 1}, requireEffectsOnce(t, pool, 1))
		})
	}
}

// A missing-id dead letter of an EventID's failure carries no id: a
// redrive of it (once dlq replay -force, once the id service is back) is
// identified by EventID again, as its first delivery would have been. It
// carried the id the message's headers held, a rule EventID replaces: the
// redrive was claimed under it (HeaderRedriveEventID), and an event whose
// republished copy had been handled under EventID's id had its effect
// twice.
func TestRedriveOfAnEventIDFailureIsIdentifiedByEventID(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	b := memsource.New(memsource.Options{Streams: 1})
	var down atomic.Bool
	down.Store(true)
	cfg := fastConfig("eventid-redrive")
	// The business key, from the payload, names the event; the message
	// ids of its copies differ.
	cfg.Identify.EventID = func(m *consumer.Message) (string, error) {
		if down.Load() {
			return "", errLookupDown
		}
		var o order
		if err := json.Unmarshal(m.Value, &o); err != nil {
			return "", err
		}
		return fmt.Sprintf("order-%d", o.N), nil
	}
	c, err := consumer.New(pool, b.Source(), insertEffect, cfg)
	require.NoError(t, err)
	start(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	publishRaw(b, "msg-1", mustJSON(t, order{N: 1}))
	require.NoError(t, b.WaitAcked(ctx, 1))
	dls := b.DeadLetters()
	require.Len(t, dls, 1)
	require.Equal(t, string(consumer.KindMissingID), dls[0].Headers[consumer.HeaderErrorKind])

	down.Store(false)
	publishRaw(b, "msg-2", mustJSON(t, order{N: 1})) // the producer's republish
	require.NoError(t, b.WaitAcked(ctx, 2))

	// The redrive, with the headers once dlq replay adds.
	h := maps.Clone(dls[0].Headers)
	if id := h[consumer.HeaderEventID]; id != "" {
		h[consumer.HeaderRedriveEventID] = id
	}
	h[consumer.HeaderRedriveConsumer] = h[consumer.HeaderConsumer]
	b.Publish(consumer.Message{Value: dls[0].Message.Value, Headers: h, Key: []byte("one stream")})
	require.NoError(t, b.WaitAcked(ctx, 3))

	assert.Equal(t, map[string]int{"order-1": 1}, countEffects(t, pool), "the redrive is the republished event's duplicate")
	assert.Equal(t, uint64(1), c.Stats().Duplicates)
}
