package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// A handler that decodes its payload itself (a []byte payload read as
// protobuf, a CloudEvent's data of another content type) and returns a
// DecodeError, wrapped or not, says what DecodeError documents: the
// message cannot be decoded, at once and on every run. It was classified
// as any handler error: run Retry.MaxAttempts times, its stream held
// through the backoffs, then dead-lettered as kind handler, where
// `once dlq -kind decode` does not find it.
func TestHandlersDecodeErrorIsDeadLetteredAtOnceAsDecode(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "bare", 1)
	publish(b, "wrapped", 2)
	runs := map[string]*atomic.Int32{"bare": {}, "wrapped": {}}
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[[]byte]) error {
		runs[ev.ID].Add(1)
		err := &consumer.DecodeError{Err: errors.New("proto: cannot parse invalid wire-format data")}
		if ev.ID == "wrapped" {
			return fmt.Errorf("reading the order: %w", err)
		}
		return err
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("handler-decode-error"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 2 }, 10*time.Second, 5*time.Millisecond)
	kinds := map[string]string{}
	for _, dl := range b.DeadLetters() {
		kinds[dl.Headers["id"]] = dl.Headers[consumer.HeaderErrorKind]
		// The handler ran, unlike a decoder's failure: its dead letter
		// counts the run (DeadLetter.Attempts, docs/kafka.md).
		assert.Equal(t, "1", dl.Headers[consumer.HeaderAttempts], "once-attempts of %s", dl.Headers["id"])
	}
	assert.Equal(t, map[string]string{"bare": string(consumer.KindDecode), "wrapped": string(consumer.KindDecode)}, kinds)
	assert.Equal(t, int32(1), runs["bare"].Load(), "a decode failure is not retried")
	assert.Equal(t, int32(1), runs["wrapped"].Load(), "a decode failure is not retried")
	assert.Equal(t, consumer.ClassPermanent, consumer.Classify(&consumer.DecodeError{Err: errors.New("x")}))
}

// RetryAfter is documented to retry whatever it wraps: a handler that
// decodes with a schema it may not have yet (a schema registry that has
// not caught up with the producer) asks for a later run of the message
// with RetryAfter around its DecodeError. Classify took the DecodeError
// inside for permanent, and the message was dead-lettered at once as
// decode, against the handler's explicit request.
func TestRetryAfterAroundADecodeErrorIsRetried(t *testing.T) {
	decodeErr := &consumer.DecodeError{Err: errors.New("unknown schema id 42")}
	assert.Equal(t, consumer.ClassRetry, consumer.Classify(consumer.RetryAfter(time.Millisecond, decodeErr)))
	assert.Equal(t, consumer.ClassRetry, consumer.Classify(fmt.Errorf("reading: %w", consumer.RetryAfter(time.Millisecond, decodeErr))))
	assert.Equal(t, consumer.ClassPermanent, consumer.Classify(fmt.Errorf("reading: %w", decodeErr)), "a DecodeError alone stays permanent")

	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "late-schema", 1)
	var runs atomic.Int32
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[[]byte]) error {
		if runs.Add(1) == 1 {
			return consumer.RetryAfter(time.Millisecond, decodeErr)
		}
		return nil
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("retry-after-decode"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 1 }, 10*time.Second, 5*time.Millisecond)
	assert.Empty(t, b.DeadLetters(), "the handler asked for a retry")
	assert.Equal(t, int32(2), runs.Load())
}
