package consumer_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// The outcome errors are exported structs: a handler may return one it
// built itself, its Err nil (&consumer.PermanentError{Err: err} with an
// err that was nil). Their Error methods dereferenced Err, and the
// consumer calls Error outside the handler's recover, to write the dead
// letter: the process crashed, every stream with it, and the message
// crashed each process after until the crash guard gave up on it.
// Such an error reads as Permanent(nil)'s and RetryAfter(d, nil)'s do.
func TestOutcomeErrorsWithoutTheirErrAreDeadLettered(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1})
	publish(b, "permanent", 1)
	publish(b, "retry-after", 2)
	publish(b, "decode", 3)
	h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
		switch ev.ID {
		case "permanent":
			return &consumer.PermanentError{}
		case "retry-after":
			return &consumer.RetryAfterError{Delay: time.Millisecond}
		}
		return &consumer.DecodeError{}
	}
	c, err := consumer.New(pool, b.Source(), h, fastConfig("zero-outcome-errors"))
	require.NoError(t, err)
	start(t, c)
	require.Eventually(t, func() bool { return b.Acked() == 3 }, 10*time.Second, 5*time.Millisecond)
	got := map[string]string{}
	for _, dl := range b.DeadLetters() {
		got[dl.Headers["id"]] = dl.Headers[consumer.HeaderErrorMessage]
	}
	assert.Equal(t, map[string]string{
		"permanent":   "permanent: permanent failure",
		"retry-after": "retry after 1ms: retry requested",
		"decode":      "decode: decode failed",
	}, got)
}
