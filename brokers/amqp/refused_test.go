package amqp_test

import (
	"context"
	"log/slog"
	"net/url"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
)

// logRecords is a slog.Handler handing every record to a channel.
type logRecords chan slog.Record

func (h logRecords) Enabled(context.Context, slog.Level) bool { return true }
func (h logRecords) Handle(_ context.Context, r slog.Record) error {
	select {
	case h <- r.Clone():
	default:
	}
	return nil
}
func (h logRecords) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h logRecords) WithGroup(string) slog.Handler      { return h }

// awaitLog waits for a record of level at least level whose message
// holds msg, and returns its "error" attribute.
func awaitLog(t *testing.T, logs logRecords, level slog.Level, msg string) string {
	t.Helper()
	timeout := time.After(20 * time.Second)
	var seen []string
	for {
		select {
		case r := <-logs:
			seen = append(seen, r.Level.String()+" "+r.Message)
			if r.Level >= level && strings.Contains(r.Message, msg) {
				var errText string
				r.Attrs(func(a slog.Attr) bool {
					if a.Key == "error" {
						errText = a.Value.String()
					}
					return true
				})
				return errText
			}
		case <-timeout:
			t.Fatalf("no %v record %q; saw %q", level, msg, seen)
		}
	}
}

// A user who cannot log in to a RabbitMQ node (wrong password, no access
// to the vhost, no permission on the queue) is refused by Open at once.
// When the refusal comes on a later reconnect of a running source (the
// password changed, the permissions revoked on the node), the source keeps
// retrying, because the fix is made on the node and it then resumes
// without a restart; but it logs the refusal as an error saying that the
// broker refuses the configuration, not as a broker that cannot be
// reached.
func TestRefusedCredentials(t *testing.T) {
	n := privateNode(t)
	n.ctl(t, "add_user", "svc", "pw-right")
	n.ctl(t, "set_permissions", "-p", "/", "svc", ".*", ".*", ".*")
	n.ctl(t, "add_user", "novhost", "pw-novhost")
	n.ctl(t, "add_user", "pw-same", "pw-same") // as guest:guest: the broker's refusal names the user, so holds the password
	n.ctl(t, "add_user", "noqueue", "pw-noqueue")
	n.ctl(t, "set_permissions", "-p", "/", "noqueue", "^$", "^$", "^$")
	n.ctl(t, "add_user", "nodl", "pw-nodl") // may write to its queues, not to the default exchange its dead letters go to
	n.ctl(t, "set_permissions", "-p", "/", "nodl", ".*", `^once-test\.`, ".*")
	as := func(user, pw string) string {
		u, err := url.Parse(n.url)
		require.NoError(t, err)
		u.User = url.UserPassword(user, pw)
		return u.String()
	}
	q := queueName(t)

	t.Run("at Open", func(t *testing.T) {
		for _, tc := range []struct{ name, url, want, secret string }{
			{"wrong password", as("svc", "pw-wrong"), "username or password not allowed", "pw-wrong"},
			{"no access to the vhost", as("novhost", "pw-novhost"), "access to vhost '/' refused", "pw-novhost"},
			{"no permission on the queue", as("noqueue", "pw-noqueue"), "ACCESS_REFUSED", "pw-noqueue"},
			{"no access to the vhost, the password in the refusal", as("pw-same", "pw-same"), "access to vhost '/' refused for user 'xxxxx'", ""},
			{"no permission to write the dead letters", as("nodl", "pw-nodl"), "access to exchange 'amq.default' in vhost '/' refused for user 'nodl'", "pw-nodl"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				_, err := amqp.Open(ctx, amqp.Config{URL: tc.url, Queue: q, Logger: testLogger(t)})
				require.Error(t, err)
				t.Log(err)
				assert.NoError(t, ctx.Err(), "the refusal was retried until the context ended")
				assert.Contains(t, err.Error(), tc.want)
				if tc.secret != "" { // else the URL's user name is the password
					assert.NotContains(t, err.Error(), tc.secret)
				}
			})
		}
	})

	// A connection limit reached (per user or per vhost) is capacity, not
	// a refusal of the configuration: connections that close free it, as
	// in a rolling deployment where the new instances start before the
	// old ones stop. Open waits for it as for a broker that cannot be
	// reached.
	t.Run("connection limit", func(t *testing.T) {
		n.ctl(t, "add_user", "limited", "pw-limited")
		n.ctl(t, "set_permissions", "-p", "/", "limited", ".*", ".*", ".*")
		n.ctl(t, "set_user_limits", "limited", `{"max-connections": 1}`)
		held, err := amqp091.Dial(as("limited", "pw-limited"))
		require.NoError(t, err)
		logs := make(logRecords, 1024)
		opened := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			src, err := amqp.Open(ctx, amqp.Config{URL: as("limited", "pw-limited"), Queue: q, Logger: slog.New(logs),
				ReconnectMinBackoff: 20 * time.Millisecond, ReconnectMaxBackoff: 100 * time.Millisecond})
			if err == nil {
				err = src.Close()
			}
			opened <- err
		}()
		for waiting := true; waiting; {
			select {
			case err := <-opened:
				_ = held.Close()
				t.Fatalf("Open returned before the limit was freed: %v", err)
			case r := <-logs:
				waiting = !strings.Contains(r.Message, "cannot connect")
			}
		}
		require.NoError(t, held.Close())
		require.NoError(t, <-opened)
	})

	t.Run("on a reconnect", func(t *testing.T) {
		logs := make(logRecords, 1024)
		src, err := amqp.Open(context.Background(), amqp.Config{URL: as("svc", "pw-right"), Queue: q,
			ReconnectMinBackoff: 20 * time.Millisecond, ReconnectMaxBackoff: 100 * time.Millisecond,
			Logger: slog.New(logs)})
		require.NoError(t, err)
		t.Cleanup(func() { _ = src.Close() })
		got := make(chan error, 1)
		go func() {
			d, err := src.Receive(context.Background())
			if err == nil {
				err = d.Ack(context.Background())
			}
			got <- err
		}()

		// The password changes on the node, and the connection drops.
		n.ctl(t, "change_password", "svc", "pw-rotated")
		n.ctl(t, "close_all_connections", "rotated")
		errText := awaitLog(t, logs, slog.LevelError, "the broker refuses")
		assert.Contains(t, errText, "username or password not allowed")
		assert.NotContains(t, errText, "pw-right")

		// The source's permissions are revoked instead.
		n.ctl(t, "change_password", "svc", "pw-right")
		awaitLog(t, logs, slog.LevelInfo, "reconnected")
		n.ctl(t, "clear_permissions", "-p", "/", "svc")
		n.ctl(t, "close_all_connections", "revoked")
		errText = awaitLog(t, logs, slog.LevelError, "the broker refuses")
		assert.Contains(t, errText, "refused for user 'svc'")

		// Restored on the node: the source resumes.
		n.ctl(t, "set_permissions", "-p", "/", "svc", ".*", ".*", ".*")
		awaitLog(t, logs, slog.LevelInfo, "reconnected")
		a := newAdminAt(t, n.url)
		require.NoError(t, a.publish("", q, jsonMsg("ev-1", `{}`)))
		select {
		case err := <-got:
			require.NoError(t, err)
		case <-time.After(20 * time.Second):
			t.Fatal("no delivery after the credentials were restored")
		}
	})
}
