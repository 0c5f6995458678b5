package consumer_test

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
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/internal/pgtest"
)

// A hook, a Decoder or an EventID function that hangs holds its stream
// with no bound of its own: once it has run past HandlerTimeout it is
// logged at Error, naming the function and the message, and counted in
// Stats.StuckCalls; the message is handled once it returns.
func TestStuckUserFunctionIsLogged(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	effects(t, pool)
	for _, fn := range []string{"OnOutcome", "OnRetry", "AfterCommit", "Decoder", "Identify.EventID"} {
		t.Run(fn, func(t *testing.T) {
			b := memsource.New(memsource.Options{Streams: 1})
			publish(b, "stuck-"+fn, 1)
			release := make(chan struct{})
			var once sync.Once
			block := func(name string) {
				if name == fn {
					once.Do(func() { <-release })
				}
			}
			log := &levelLog{}
			cfg := fastConfig("stuck-" + strings.ReplaceAll(fn, ".", "-"))
			cfg.Telemetry.Logger = slog.New(log)
			cfg.HandlerTimeout = 100 * time.Millisecond
			cfg.Hooks = consumer.Hooks{
				OnOutcome:   func(context.Context, consumer.Outcome) { block("OnOutcome") },
				OnRetry:     func(context.Context, consumer.Retry) { block("OnRetry") },
				AfterCommit: func(context.Context, []consumer.Committed) { block("AfterCommit") },
			}
			cfg.Decoder = func(data []byte, v any) error {
				block("Decoder")
				return consumer.JSON(data, v)
			}
			cfg.Identify.EventID = func(m *consumer.Message) (string, error) {
				block("Identify.EventID")
				return m.Headers["id"], nil
			}
			failed := false
			h := func(ctx context.Context, tx pgx.Tx, ev consumer.Event[order]) error {
				if !failed {
					failed = true
					return errors.New("once more") // one retry, for OnRetry
				}
				return insertEffect(ctx, tx, ev)
			}
			c, err := consumer.New(pool, b.Source(), h, cfg)
			require.NoError(t, err)
			stop := start(t, c)
			unblock := sync.OnceFunc(func() { close(release) })
			defer unblock() // a failed wait must not leave the function blocked
			stuck := func() string {
				for _, l := range log.lines() {
					if strings.HasPrefix(l, "ERROR ") && strings.Contains(l, "function="+fn+" ") {
						return l
					}
				}
				return ""
			}
			require.Eventually(t, func() bool { return stuck() != "" }, 20*time.Second, 5*time.Millisecond,
				"no error-level record of the stuck %s in %q", fn, log.lines())
			if fn != "OnRetry" {
				assert.Contains(t, stuck(), "offset=0")
			}
			if fn != "Identify.EventID" {
				assert.Contains(t, stuck(), "event_id=stuck-"+fn)
			}
			assert.Equal(t, uint64(1), c.Stats().StuckCalls)
			unblock()
			require.Eventually(t, func() bool { return b.Acked() == 1 }, 20*time.Second, 5*time.Millisecond)
			require.NoError(t, stop())
			assert.Equal(t, uint64(1), c.Stats().StuckCalls, "logged once")
		})
	}
}
