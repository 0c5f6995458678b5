package outbox_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
)

// confirmingPublisher confirms every record and keeps their event ids.
type confirmingPublisher struct {
	mu  sync.Mutex
	ids map[string]int
}

func (p *confirmingPublisher) Publish(_ context.Context, recs []outbox.Record) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range recs {
		p.ids[r.EventID]++
	}
	return nil
}

func (*confirmingPublisher) Close() error { return nil }

func (p *confirmingPublisher) published() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]int, len(p.ids))
	for id, n := range p.ids {
		out[id] = n
	}
	return out
}

// A leader's session whose server vanished without a word reaching the
// relay's host (a failover's old primary, a middlebox that forgot the
// connection) left the relay's next statement on it unanswered until the
// operating system gave up on the connection (a quarter of an hour with
// Linux's defaults; for ever here, where the proxy's kernel still
// acknowledges): nothing was published meanwhile, by this relay or
// another, as the server had ended the session and its leader lock while
// this relay still took itself for the leader. Each of the relay's
// statements is bounded: it ends the session and leads on a new one.
func TestLeaderSessionStrandedByItsServerIsLeftBehind(t *testing.T) {
	pool, schema := migrated(t)
	relayPool, proxy := pgtest.NewPoolThroughProxy(t, schema, nil)
	pub := &confirmingPublisher{ids: map[string]int{}}
	startRelay(t, relayPool, pub, outbox.RelayConfig{PollInterval: 20 * time.Millisecond,
		InfraBackoff: outbox.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	msg := func(i int) outbox.Message {
		return outbox.Message{ID: fmt.Sprintf("m%d", i), Topic: "orders", Body: []byte("{}")}
	}
	addCommitted(t, pool, msg(0))
	waitRows(t, pool, "true", 0, 10*time.Second)

	require.Positive(t, proxy.Strand(), "the leader's session stranded")
	addCommitted(t, pool, msg(1))
	waitRows(t, pool, "true", 0, 40*time.Second)
	assert.Equal(t, map[string]int{"m0": 1, "m1": 1}, pub.published())
}
