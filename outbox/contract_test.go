package outbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// shortAnswers is a publisher that, while short is set, answers a batch
// with one error fewer than it has records (all nil): a broken contract.
type shortAnswers struct {
	outbox.Publisher
	short atomic.Bool
	calls atomic.Int64
}

func (p *shortAnswers) Publish(ctx context.Context, recs []outbox.Record) []error {
	errs := p.Publisher.Publish(ctx, recs)
	p.calls.Add(1)
	if !p.short.Load() {
		return errs
	}
	return make([]error, len(recs)-1)
}

// A publisher that answers a batch with fewer errors than records breaks
// Publisher's contract: the relay cannot tell which records the broker
// confirmed, so it deletes none and charges none, logs the broken
// contract at level Error and tries again after InfraBackoff (an index out
// of range once crashed the process), and publishes them once the
// publisher answers one error per record.
func TestRelaySurvivesAPublisherThatAnswersTooFewErrors(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	pub := &shortAnswers{Publisher: k.publisher(t)}
	pub.short.Store(true)
	var warns atomic.Int64
	startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, Logger: countingLogger(&warns),
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond}})
	addCommitted(t, pool, d.msg("a", "1"), d.msg("b", "2"), d.msg("c", "3"))
	require.Eventually(t, func() bool { return pub.calls.Load() >= 2 && warns.Load() >= 2 }, 10*time.Second, 10*time.Millisecond,
		"the broken answers are logged and retried")
	assert.Equal(t, 3, rows(t, pool, "attempts = 0 AND sent_at IS NULL"), "no row is deleted or charged on a broken answer")
	pub.short.Store(false)
	waitRows(t, pool, "true", 0, 10*time.Second)
}

// panicking is a publisher whose Publish panics while publishPanics is
// set, and whose Check panics on records to the topic checkPanics names.
type panicking struct {
	outbox.Publisher
	publishPanics atomic.Bool
	checkPanics   atomic.Value // string
	panics        atomic.Int64
}

func (p *panicking) Publish(ctx context.Context, recs []outbox.Record) []error {
	if p.publishPanics.Load() {
		p.panics.Add(1)
		panic("publisher bug")
	}
	return p.Publisher.Publish(ctx, recs)
}

func (p *panicking) Check(rec outbox.Record) error {
	if topic, _ := p.checkPanics.Load().(string); topic != "" && rec.Topic == topic {
		p.panics.Add(1)
		panic("checker bug")
	}
	return p.Publisher.(outbox.Checker).Check(rec)
}

// A publisher whose Publish panics does not crash the process (the panic
// was on the relay's publishing goroutine, where nothing recovered it).
// A panic cannot be told from a record that causes it, so each record is
// published alone and the one whose publish panics is charged like a
// refusal, the panic as its error; a Publish that panics on every record
// has each charged so, and the rows are published once Publish works
// again (before MaxAttempts; TestPublishThatPanicsOnOneRecordParksIt has
// one parked).
func TestRelaySurvivesAPanickingPublish(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	pub := &panicking{Publisher: k.publisher(t)}
	pub.publishPanics.Store(true)
	var warns atomic.Int64
	startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, Logger: countingLogger(&warns), MaxAttempts: 1000,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond}})
	addCommitted(t, pool, d.msg("a", "1"), d.msg("b", "2"))
	require.Eventually(t, func() bool { return pub.panics.Load() >= 3 && warns.Load() >= 2 }, 10*time.Second, 10*time.Millisecond,
		"the panics are logged and retried")
	waitRows(t, pool, "attempts > 0 AND last_error = 'the publisher''s Publish panicked: publisher bug'", 2, 10*time.Second)
	pub.publishPanics.Store(false)
	waitRows(t, pool, "true", 0, 10*time.Second)
	assert.Len(t, d.read(t, 2), 2)
}

// A publisher whose Check panics on a record does not crash the process:
// the panic is charged to that record like a refusal (parked after
// MaxAttempts, with the panic as its error), and the other records are
// published.
func TestRelaySurvivesAPanickingCheck(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	other := k.destination(t)
	pub := &panicking{Publisher: k.publisher(t)}
	bad := other.msg("a", "poison")
	pub.checkPanics.Store(bad.Topic)
	startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond}})
	addCommitted(t, pool, bad, d.msg("b", "1"))
	waitRows(t, pool, "parked_at IS NOT NULL AND last_error LIKE '%checker bug%'", 1, 10*time.Second)
	waitRows(t, pool, "true", 1, 10*time.Second)
	assert.Len(t, d.read(t, 1), 1)
}
