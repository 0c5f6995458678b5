package outbox_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// failingCheck is a publisher whose Check cannot decide (a lookup that
// times out): not a refusal, so the record waits for a later batch.
type failingCheck struct {
	outbox.Publisher
	failing atomic.Bool
}

func (p *failingCheck) Check(rec outbox.Record) error {
	if p.failing.Load() {
		return errors.New("exchange lookup: timed out")
	}
	return nil
}

// Records the publisher cannot check wait for a later batch, uncharged:
// while that lasts the relay says so at level Warn, with the checker's
// error (it held them with no log and no metric, the outbox standing still
// in silence), and publishes them once the check works again.
func TestRecordsThePublisherCannotCheckAreLogged(t *testing.T) {
	k := newKafka(t)
	pool, _ := migrated(t)
	d := k.destination(t)
	pub := &failingCheck{Publisher: k.publisher(t)}
	pub.failing.Store(true)
	var warns atomic.Int64
	startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, Logger: countingLogger(&warns)})
	addCommitted(t, pool, d.msg("k", "a"))
	require.Eventually(t, func() bool { return warns.Load() > 0 }, 10*time.Second, 10*time.Millisecond,
		"records held by a check that cannot decide are logged")
	waitRows(t, pool, "attempts = 0", 1, time.Second)
	pub.failing.Store(false)
	waitRows(t, pool, "true", 0, 10*time.Second)
	assert.Len(t, d.read(t, 1), 1)
}
