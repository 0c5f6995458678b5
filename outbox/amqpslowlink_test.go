package outbox_test

import (
	"crypto/rand"
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/netcut"
	"github.com/onceco/once/outbox"
	"github.com/onceco/once/outbox/amqpout"
)

// On a link too slow to carry a batch within amqpout's ConfirmTimeout (a
// full read of 16 MiB over 10 Mbit/s takes 13 s, the default timeout is
// 10 s), the timeout bounded the batch's write as well as its confirms, as
// if the broker had blocked the connection: the connection was dropped
// with the batch half written, every retry the same, and the relay never
// got past the batch, nothing charged, nothing published. A write the
// broker is taking is given the time it needs; only one that makes no
// progress for ConfirmTimeout is given up
// (TestRelayUnderARabbitMQAlarmKeepsConfirmTimeout).
func TestBatchSlowerToWriteThanConfirmTimeoutIsPublished(t *testing.T) {
	r := rabbitOrSkip(t)
	d := r.destination(t)
	u, err := url.Parse(r.url)
	require.NoError(t, err)
	proxy, err := netcut.NewProxy(u.Host)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	u.Host = proxy.Addr()
	// 1 MiB/s: the batch's 12 MiB take about 12 s to cross, and what the
	// sockets' buffers hold (a few MiB) leaves the write some 8 s at the
	// least, well past ConfirmTimeout, while a record of the batch reaches
	// the broker, and its confirm comes back, every quarter of a second.
	proxy.Throttle(1 << 20)
	pub, err := amqpout.New(amqpout.Config{URL: u.String(), ConfirmTimeout: 3 * time.Second, DialTimeout: 10 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	pool, _ := migrated(t)
	const n, size = 48, 256 << 10
	var msgs []outbox.Message
	for i := range n {
		body := make([]byte, size)
		_, _ = rand.Read(body)
		msgs = append(msgs, d.msg("", fmt.Sprintf("%d/%x", i, body)[:size]))
	}
	addCommitted(t, pool, msgs...)
	startRelay(t, pool, pub, outbox.RelayConfig{PollInterval: 50 * time.Millisecond, MaxAttempts: 1})
	defer func() { t.Logf("rows left: %d of %d", rows(t, pool, "true"), n) }()
	waitRows(t, pool, "true", 0, 90*time.Second)
	proxy.Throttle(0)
	distinct, _ := ids(d.read(t, n))
	assert.Len(t, distinct, n, "every row published")
}
