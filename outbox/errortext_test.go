package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/onceco/once/outbox"
)

// bodyQuotingRefusals refuses the records of one topic with an error that
// quotes their body as it is, as a publisher that validates payloads may
// ("schema check failed on ..."), and publishes the others with its
// Publisher.
type bodyQuotingRefusals struct {
	outbox.Publisher
	topic string
}

func (p *bodyQuotingRefusals) Publish(ctx context.Context, recs []outbox.Record) []error {
	errs := make([]error, len(recs))
	var ok []outbox.Record
	var at []int
	for i, rec := range recs {
		if rec.Topic == p.topic {
			errs[i] = outbox.Rejected(fmt.Errorf("schema check failed on %s", rec.Body))
			continue
		}
		ok, at = append(ok, rec), append(at, i)
	}
	if len(ok) > 0 {
		for j, err := range p.Publisher.Publish(ctx, ok) {
			errs[at[j]] = err
		}
	}
	return errs
}

// A refusal's text is stored as the row's last_error, a text column,
// which takes neither a NUL byte nor bytes that are not UTF-8. A
// publisher's error quoting a binary body (a bytea, anything) failed the
// settlement that charges the row, written again after every backoff for
// ever: the relay published no row of any key. The text is stored without
// them; the row is charged and parked, and the others are published.
func TestRefusalWhoseTextIsNotStorableIsCharged(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	bad := k.destination(t).msg("a", "\x00\xffbinary")
	startRelay(t, pool, &bodyQuotingRefusals{Publisher: k.publisher(t), topic: bad.Topic}, outbox.RelayConfig{
		PollInterval: 20 * time.Millisecond, MaxAttempts: 2, Logger: testLogger(),
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond}})
	addCommitted(t, pool, bad, d.msg("b", "1"))
	waitRows(t, pool, "parked_at IS NOT NULL AND attempts = 2 AND last_error LIKE 'schema check failed on %binary'", 1, 30*time.Second)
	waitRows(t, pool, "true", 1, 30*time.Second)
	assert.Equal(t, []string{"1"}, bodies(d.read(t, 1)))
}
