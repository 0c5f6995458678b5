package outbox_test

import (
	"bytes"
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// poisonPublisher is a publisher whose Publish panics on any batch that
// holds a record with the body poison, as a publisher with a bug that one
// record's contents trigger would.
type poisonPublisher struct {
	outbox.Publisher
	poison []byte
}

func (p *poisonPublisher) Publish(ctx context.Context, recs []outbox.Record) []error {
	for _, rec := range recs {
		if bytes.Equal(rec.Body, p.poison) {
			panic("publisher bug on " + string(rec.Body))
		}
	}
	return p.Publisher.Publish(ctx, recs)
}

// A record that makes Publish panic every time is a poison row: the
// relay publishes the batch's records one at a time to find it, charges
// it an attempt like a refusal and parks it after MaxAttempts, with the
// panic as its error; the later rows of its key wait behind it, uncharged,
// and every other key is published. (It was retried uncharged for ever,
// logged at level Error, and held back every other row of its batch.)
func TestPublishThatPanicsOnOneRecordParksIt(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	pub := &poisonPublisher{Publisher: k.publisher(t), poison: []byte("poison")}
	startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond},
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond}})
	addCommitted(t, pool, d.msg("a", "1"), d.msg("p", "poison"), d.msg("b", "2"), d.msg("p", "after"), d.msg("c", "3"))
	waitRows(t, pool, "parked_at IS NOT NULL AND attempts = 2 AND last_error LIKE '%Publish panicked: publisher bug on poison'", 1, 20*time.Second)
	waitRows(t, pool, "true", 2, 10*time.Second)
	assert.Equal(t, 1, rows(t, pool, "convert_from(body, 'UTF8') = 'after' AND attempts = 0 AND parked_at IS NULL"),
		"the later row of the poison row's key waits, uncharged")
	assert.ElementsMatch(t, []string{"1", "2", "3"}, bodies(d.read(t, 3)))

	store, err := outbox.New(outbox.Config{})
	require.NoError(t, err)
	parked, err := store.Parked(context.Background(), pool, 0)
	require.NoError(t, err)
	require.Len(t, parked, 1)
	n, err := store.Discard(context.Background(), pool, parked[0].Seq)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	waitRows(t, pool, "true", 0, 10*time.Second)
	assert.ElementsMatch(t, []string{"1", "2", "3", "after"}, bodies(d.read(t, 4)))
}

// nilError is an error type whose Error dereferences its receiver: a nil
// *nilError returned as an error (the classic typed nil) panics when its
// text is asked for.
type nilError struct{ msg string }

func (e *nilError) Error() string { return e.msg }

// typedNilRefusals is a publisher that refuses the records of one topic
// with Rejected around a typed nil.
type typedNilRefusals struct {
	outbox.Publisher
	topic string
}

func (p *typedNilRefusals) Publish(ctx context.Context, recs []outbox.Record) []error {
	errs := make([]error, len(recs))
	var ok []outbox.Record
	var at []int
	for i, rec := range recs {
		if rec.Topic == p.topic {
			var e *nilError
			errs[i] = outbox.Rejected(e)
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

// A custom publisher's refusal whose text panics (a typed nil wrapped with
// Rejected) crashed the process where the relay wrote the refusal to its
// row. The row is charged and parked with what could be told of the
// error, and the other rows are published.
func TestRefusalWhoseTextPanicsIsCharged(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	bad := k.destination(t).msg("a", "bad")
	pub := &typedNilRefusals{Publisher: k.publisher(t), topic: bad.Topic}
	startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond}})
	addCommitted(t, pool, bad, d.msg("b", "1"))
	waitRows(t, pool, "parked_at IS NOT NULL AND attempts = 2 AND last_error LIKE '%PANIC%'", 1, 20*time.Second)
	waitRows(t, pool, "true", 1, 10*time.Second)
	assert.Equal(t, []string{"1"}, bodies(d.read(t, 1)))
}

// countingPublisher counts the calls of its Publisher's Publish.
type countingPublisher struct {
	outbox.Publisher
	calls atomic.Int64
}

func (p *countingPublisher) Publish(ctx context.Context, recs []outbox.Record) []error {
	p.calls.Add(1)
	return p.Publisher.Publish(ctx, recs)
}

// The record a batch's Publish panics on is found by publishing the batch
// again in halves: about 2·log2(n) publishes for a batch of n, where one
// at a time cost n (256 publishes, each under PublishTimeout, for a batch
// of 256). Every other record is published and settled.
func TestPoisonRecordInAFullBatchIsFoundInHalves(t *testing.T) {
	const n = 256
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	msgs := make([]outbox.Message, n)
	var want []string
	for i := range msgs {
		body := strconv.Itoa(i)
		if i == 200 {
			body = "poison"
		} else {
			want = append(want, body)
		}
		msgs[i] = d.msg("k"+strconv.Itoa(i), body)
	}
	addCommitted(t, pool, msgs...) // before the relay starts: read as one batch
	pub := &countingPublisher{Publisher: &poisonPublisher{Publisher: k.publisher(t), poison: []byte("poison")}}
	startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, BatchSize: n, MaxAttempts: 1,
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 10 * time.Millisecond}})
	waitRows(t, pool, "parked_at IS NOT NULL AND last_error LIKE '%Publish panicked: publisher bug on poison'", 1, 20*time.Second)
	waitRows(t, pool, "true", 1, 20*time.Second)
	assert.ElementsMatch(t, want, bodies(d.read(t, n-1)))
	assert.LessOrEqual(t, pub.calls.Load(), int64(1+2*8), "one publish of the batch, then two for each of log2(256) levels")
}
