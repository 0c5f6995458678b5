package amqp_test

import (
	"context"
	"io"
	"net"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
)

// dialCounter forwards TCP connections to a broker and counts those it
// accepted, closed ones included.
type dialCounter struct {
	ln       net.Listener
	upstream string
	accepted atomic.Int64
}

// countDials puts a dialCounter in front of the broker at brokerURL and
// returns it and the broker URL through it.
func countDials(t testing.TB, brokerURL string) (*dialCounter, string) {
	t.Helper()
	u, err := url.Parse(brokerURL)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	c := &dialCounter{ln: ln, upstream: u.Host}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			c.accepted.Add(1)
			go func() {
				defer conn.Close()
				up, err := net.DialTimeout("tcp", c.upstream, 5*time.Second)
				if err != nil {
					return
				}
				defer up.Close()
				go func() { _, _ = io.Copy(up, conn); _ = up.Close() }()
				_, _ = io.Copy(conn, up)
			}()
		}
	}()
	u.Host = ln.Addr().String()
	return c, u.String()
}

// TestDeadLetterRefusedReusesTheConnection: the broker refuses each copy
// to a dead-letter exchange made internal since Open (ACCESS_REFUSED) or,
// with Passive, deleted since (NOT_FOUND), by closing the dead-letter
// channel. The connection stays up: each retry opens a channel on it
// instead of dialling a connection of its own, which, retried for as long
// as the refusal lasts, churned a connection per attempt on the broker.
// The message stays unacked until the exchange takes the copy again.
func TestDeadLetterRefusedReusesTheConnection(t *testing.T) {
	for _, tc := range []struct {
		name    string
		passive bool // the exchange is deleted under Passive; else made internal
	}{{"internal exchange", false}, {"exchange deleted under Passive", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			a := newAdmin(t)
			q := queueName(t)
			dlq := q + amqp.DeadLetterQueueSuffix
			x := q + ".dlx"
			ch, err := a.channel()
			require.NoError(t, err)
			restore := func() {
				t.Helper()
				ch, err := a.channel()
				require.NoError(t, err)
				require.NoError(t, ch.ExchangeDelete(x, false, false))
				require.NoError(t, ch.ExchangeDeclare(x, "direct", true, false, false, false, nil))
				require.NoError(t, ch.QueueBind(dlq, dlq, x, false, nil))
			}
			cfg := amqp.Config{Queue: q, DeadLetter: amqp.DeadLetterConfig{Exchange: x}}
			if tc.passive {
				a.declare(q, amqp.QueueClassic)
				_, err = ch.QueueDeclare(dlq, true, false, false, false, nil)
				require.NoError(t, err)
				restore()
				cfg.Passive = true
				cfg.DeadLetter.RoutingKey, cfg.DeadLetter.Queue = dlq, dlq
			} else {
				a.cleanupQueue(q)
			}
			t.Cleanup(func() {
				if ch, err := a.channel(); err == nil {
					_ = ch.ExchangeDelete(x, false, false)
				}
			})
			dials, through := countDials(t, brokerURL(t))
			cfg.URL = through
			src := openSource(t, cfg)
			require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
			d := receive(t, src)
			atOpen := dials.accepted.Load() // the consuming connection and Open's check

			if tc.passive {
				require.NoError(t, ch.ExchangeDelete(x, false, false))
			} else {
				a.declareInternal(x, dlq, dlq)
			}
			const attempts = 6
			for range attempts {
				require.Error(t, deadLetterWithRetries(d, 1))
			}
			assert.Equal(t, atOpen+1, dials.accepted.Load(),
				"%d refused copies dialled %d connections; want the one dead-letter connection", attempts, dials.accepted.Load()-atOpen)

			restore()
			require.NoError(t, deadLetterWithRetries(d, 1))
			require.NoError(t, d.Ack(context.Background()))
			assert.Equal(t, atOpen+1, dials.accepted.Load(), "the copy that went through dialled again")
			got, err := a.getAll(dlq)
			require.NoError(t, err)
			require.Len(t, got, 1)
			assert.Equal(t, "ev-1", got[0].MessageId)
		})
	}
}

// TestDeadLetterDestinationRedeclareRefusedReusesTheConnection: the
// dead-letter exchange is deleted while the source runs, and the source's
// user may no longer configure it, so the declaration the source makes
// again after the copy found the exchange missing is refused too, on every
// attempt. The declaration runs on a channel of the dead-letter connection
// that is not blocked, not on a connection dialled for it: each attempt
// dialled two (one to declare, one to publish). Once the permission is
// back, the exchange is declared again and the copy goes out.
func TestDeadLetterDestinationRedeclareRefusedReusesTheConnection(t *testing.T) {
	t.Parallel()
	n := privateNode(t)
	n.ctl(t, "add_user", "svc", "pw-svc")
	n.ctl(t, "set_permissions", "-p", "/", "svc", ".*", ".*", ".*")
	u, err := url.Parse(n.url)
	require.NoError(t, err)
	u.User = url.UserPassword("svc", "pw-svc")
	a := newAdminAt(t, n.url)
	q := queueName(t)
	x := q + ".dlx"
	dials, through := countDials(t, u.String())
	src := openSource(t, amqp.Config{URL: through, Queue: q, DeadLetter: amqp.DeadLetterConfig{Exchange: x}})
	require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
	d := receive(t, src)
	atOpen := dials.accepted.Load()

	n.ctl(t, "set_permissions", "-p", "/", "svc", "^$", ".*", ".*") // no configure
	ch, err := a.channel()
	require.NoError(t, err)
	require.NoError(t, ch.ExchangeDelete(x, false, false))
	const attempts = 6
	for range attempts {
		require.Error(t, deadLetterWithRetries(d, 1))
	}
	assert.Equal(t, atOpen+1, dials.accepted.Load(),
		"%d attempts dialled %d connections; want the one dead-letter connection", attempts, dials.accepted.Load()-atOpen)

	n.ctl(t, "set_permissions", "-p", "/", "svc", ".*", ".*", ".*")
	require.NoError(t, deadLetterWithRetries(d, 3))
	require.NoError(t, d.Ack(context.Background()))
	got, err := a.getAll(q + amqp.DeadLetterQueueSuffix)
	require.NoError(t, err)
	require.Len(t, got, 1)
	assert.Equal(t, "ev-1", got[0].MessageId)
}
