package outbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/outbox"
)

// A leader whose host dies (or is cut off) sends no FIN: PostgreSQL keeps
// its session, and the leader lock with it, until the server's TCP
// keepalives give up on the peer, after the operating system's default of
// two hours and more. No other relay could lead meanwhile. The relay's
// session asks the server for keepalives that give up within about a
// minute (tcp_keepalives_idle 30 s, 3 probes 10 s apart, tcp_user_timeout
// 60 s), unless the connection string sets them. The loss of a host cannot
// be simulated here without packet filtering, so the test reads what the
// leader's session runs with, through the pool's BeforeClose hook, which
// the relay calls with its session before closing it: the session is
// ended by making the table again (a session ended by its context has
// its connection closed already).
func TestLeaderSessionAsksTheServerForKeepalives(t *testing.T) {
	for _, tc := range []struct {
		name   string
		params map[string]string
		idle   string
	}{
		{name: "defaults", idle: "30"},
		{name: "the connection string's kept", params: map[string]string{"tcp_keepalives_idle": "7"}, idle: "7"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			k := newKafka(t)
			base, _ := migrated(t)
			cfg := base.Config()
			for name, v := range tc.params {
				cfg.ConnConfig.RuntimeParams[name] = v
			}
			var (
				mu   sync.Mutex
				seen map[string]string
			)
			cfg.BeforeClose = func(c *pgx.Conn) {
				cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				got := map[string]string{}
				for _, name := range []string{"tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count", "tcp_user_timeout"} {
					var v string
					if err := c.QueryRow(cctx, "SELECT current_setting($1)", name).Scan(&v); err == nil {
						got[name] = v
					}
				}
				var locks int
				if err := c.QueryRow(cctx, `SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'`).Scan(&locks); err != nil || locks == 0 {
					return // a pool connection, not the leader's session
				}
				mu.Lock()
				seen = got
				mu.Unlock()
			}
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)

			r, stop := startRelay(t, pool, k.publisher(t), outbox.RelayConfig{PollInterval: 20 * time.Millisecond})
			require.Eventually(t, r.Leader, 10*time.Second, 5*time.Millisecond)
			s, err := outbox.New(outbox.Config{})
			require.NoError(t, err)
			_, err = pool.Exec(ctx, `DROP TABLE outbox; `+s.SchemaSQL())
			require.NoError(t, err)
			require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return seen != nil }, 10*time.Second, 5*time.Millisecond,
				"the leader's session ended, through BeforeClose")
			stop()
			mu.Lock()
			defer mu.Unlock()
			assert.Equal(t, map[string]string{
				"tcp_keepalives_idle":     tc.idle,
				"tcp_keepalives_interval": "10",
				"tcp_keepalives_count":    "3",
				"tcp_user_timeout":        "60000",
			}, seen)
		})
	}
}
