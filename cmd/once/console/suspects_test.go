package console_test

import (
	"context"
	"errors"
	"regexp"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/internal/testenv"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// consumerRow is the billing consumer's row on the consumers page.
var consumerRow = regexp.MustCompile(`(?s)<tr data-consumer="billing">.*?</tr>`)

// A message that may be a redelivery is handled alone, and the crash guard
// counts its handler's runs in the attempts column: a run that failed is
// one more, with no crash. The consumers page took a count above one for
// a process that died with the message ("a crash suspect"), and showed a
// message whose handler failed once and ran again, in a process alive and
// well, as a crash suspect. Crashes are counted in the crashes column.
func TestOverviewDoesNotTakeAFailedRunForACrash(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	b := memsource.New(memsource.Options{Streams: 1})
	b.Publish(consumer.Message{Value: []byte(`{}`), Headers: map[string]string{"id": "pay-1"}, Redelivered: true})
	var runs atomic.Int32
	second, release := make(chan struct{}), make(chan struct{})
	h := func(ctx context.Context, _ pgx.Tx, _ consumer.Event[map[string]any]) error {
		if runs.Add(1) == 1 {
			return errors.New("payment service busy")
		}
		close(second)
		<-release
		return nil
	}
	c, err := consumer.New(pool, b.Source(), h, consumer.Config{Name: "billing",
		Retry:     consumer.RetryPolicy{MaxAttempts: 3, InitialBackoff: time.Millisecond},
		Telemetry: consumer.TelemetryConfig{Logger: testenv.Logger()}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); assert.NoError(t, <-done, "Run") })
	defer close(release)
	<-second // the first run failed; the second is running

	hd, err := console.New(console.Config{DB: pool, Logger: testenv.Logger()})
	require.NoError(t, err)
	_, body := serve(t, hd, "/")
	row := consumerRow.FindString(body)
	require.NotEmpty(t, row, body)
	assert.Contains(t, row, `<td class="num">1</td><td class="num">0</td>`,
		"one message in flight, no crash suspect: its handler failed once, no process died")
}
