package outbox_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// syncBuffer is a bytes.Buffer safe for the relay's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *syncBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// An outbox table made UNLOGGED (for speed) is emptied by PostgreSQL
// after a crash, while the tables written beside its rows keep their
// changes: the messages of committed transactions not yet published are
// lost. The relay warns at start, naming the table; a logged table gets
// no warning.
func TestUnloggedOutboxTableIsWarnedOfAtStart(t *testing.T) {
	pool, _ := migrated(t)
	run := func(t *testing.T) string {
		t.Helper()
		var logs syncBuffer
		r, stop := startRelay(t, pool, nopPublisher{}, outbox.RelayConfig{PollInterval: 20 * time.Millisecond,
			Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
		require.Eventually(t, r.Leader, 10*time.Second, 5*time.Millisecond, "the relay runs")
		stop()
		return logs.String()
	}
	assert.NotContains(t, run(t), "UNLOGGED", "the table Migrate made is logged")
	_, err := pool.Exec(context.Background(), `ALTER TABLE outbox SET UNLOGGED`)
	require.NoError(t, err)
	logged := run(t)
	assert.Contains(t, logged, "UNLOGGED")
	assert.True(t, strings.Contains(logged, "outbox"), logged)
}
