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
